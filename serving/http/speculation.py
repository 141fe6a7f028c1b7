"""The request body's ``speculation`` object, generated from the method catalogue.

Its fixed fields are the method, ``k`` and ``n_drafts``; every other field is a method's own
option (``specops.serving.proposers.catalogue``: each ``MethodSpec.options`` model). The JSON
schema lists the catalogue's methods and all their options as registered when it is asked for;
a field no method owns is refused here, and the plan validates the given options against the
named method's model (``specops.serving.fleet.planner.choose_method``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specops.serving.proposers.catalogue import CATALOGUE, methods


def _choices() -> str:
    """The catalogue's methods as pydantic words a Literal's choices: ``'a', 'b' or 'c'``."""
    names = [repr(n) for n in methods()]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _method_enum(schema: dict) -> None:
    """A method field's JSON schema: the catalogue's names now (the schema is built when asked)."""
    schema.clear()
    schema.update({"enum": list(methods()), "type": "string"})


class FieldValueError(ValueError):
    """What a model-level validator (one that compares fields) raises: pydantic gives its error no
    location, so ``field`` (dotted, relative to the model) names the one to fix, and the API
    reports it as the error's ``param``. Every model validator here raises this."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _speculation_schema(schema: dict) -> None:
    """The ``speculation`` object's JSON schema: ``method``'s choices and every method's options
    (``specops.serving.proposers.catalogue``: each :class:`MethodSpec`'s ``options`` model), as
    registered when the schema is asked for."""
    props = schema.setdefault("properties", {})
    _method_enum(props["method"]["anyOf"][0])
    for name, (prop, owners) in option_fields().items():
        props[name] = {**prop, "description": f"{' and '.join(owners)}: {prop.get('description', '')}".strip()}
    schema["additionalProperties"] = False


def option_fields() -> dict[str, tuple[dict, list[str]]]:
    """Every method's request options: field name -> (its JSON schema, the methods that take it)."""
    out: dict[str, tuple[dict, list[str]]] = {}
    for spec in CATALOGUE.values():
        props = spec.options.model_json_schema().get("properties", {})
        for name, field in spec.options.model_fields.items():
            prop = {k: v for k, v in props.get(name, {}).items() if k != "title"}
            prop.setdefault("description", field.description or "")
            out.setdefault(name, (prop, []))[1].append(spec.name)
    return out


class Speculation(BaseModel):
    """Extension: how to speculate for this request: the method, ``k``, ``n_drafts``, and the
    method's own options (its catalogue entry's options model; validated when the plan is built)."""

    model_config = ConfigDict(
        extra="allow", strict=True, allow_inf_nan=False, json_schema_extra=lambda s, _: _speculation_schema(s)
    )

    method: str | None = None
    """One of the catalogue's methods (``specops.serving.proposers.catalogue``), as registered when the request
    comes: draft = the cluster's draft model; pld = prompt lookup; target = target-only (no speculation)."""
    k: int | None = Field(None, ge=1)
    """Tokens drafted per verification step (bounded by the server's max_k)."""
    n_drafts: int | None = Field(None, ge=1)
    """Rows drafted per step by a multi-draft method (dresd, llma), verified as one token tree
    (bounded by the server's max_n_drafts)."""

    @field_validator("method", mode="before")
    @classmethod
    def _known(cls, v: Any) -> Any:
        if v is not None and not (isinstance(v, str) and v in CATALOGUE):
            raise ValueError(f"Input should be {_choices()}")
        return v

    @model_validator(mode="after")
    def _options_known(self) -> Speculation:
        known = option_fields()
        for name in self.model_extra or {}:
            if name not in known:
                raise FieldValueError(name, f"unrecognized request argument: speculation.{name}")
        return self

    @property
    def options(self) -> dict[str, Any]:
        """The method options the request gave (validated by the method's options model in the plan)."""
        return dict(self.model_extra or {})
