"""The domains (clusters) this process runs or reports: ``--domains`` for a run, those a report
measured for ``--replot`` and ``--merge``. Read ``scope.DOMAINS`` at call time: :func:`set_domains`
replaces it."""

from __future__ import annotations

from specops.workloads.chat_workload import ALL_DOMAINS, DOMAINS


def set_domains(names) -> None:
    """The domains (clusters) this process runs or reports: ``--domains`` for a run; for
    ``--replot`` and ``--merge``, those the report measured."""
    global DOMAINS
    names = tuple(names)
    unknown = [d for d in names if d not in ALL_DOMAINS]
    if unknown or not names:
        raise SystemExit(f"--domains: unknown {unknown or 'none given'}; choose from {', '.join(ALL_DOMAINS)}")
    DOMAINS = names


def report_domains(report: dict) -> list[str]:
    """The domains a report measured, in :data:`ALL_DOMAINS` order."""
    return [d for d in ALL_DOMAINS if d in (report.get("static") or {})]


__all__ = ["DOMAINS", "report_domains", "set_domains"]
