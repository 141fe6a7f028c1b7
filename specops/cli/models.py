"""``specops models check|push``: a models directory checked as serving loads it, and uploaded for the chart.

boto3 and the tokenizer libraries load when a subcommand runs, not while ``specops --help`` builds the parser."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

from specops.cli.common import add_group, fail, prose
from specops.paths import models_dir

LAYOUT = prose(
    """
    A models directory holds target/ (a Hugging Face causal LM: config.json, *.safetensors weights, no pickled .bin,
    its tokenizer files), draft/ (the same, with the target's tokenizer), embedder/ (the router's MiniLM embedder,
    which `specops bootstrap --embedder-only --out DIR` copies there) and optionally manifest.json (a bootstrap's
    record). Its completion marker ready.json, written last, lists every file with its size and sha256; the Helm
    chart's pods wait for it.
    """
)

CHECK = prose(
    f"""
    Checks DIR the way serving checks it when it loads, without loading any weights: config.json and safetensors
    weights in target/ and draft/ (nothing pickled, every shard an index names), one vocabulary size, one tokenizer
    (the sha256 serving compares), and embedder/ complete (required unless --no-embedder). Prints what is wrong and
    how to fix it (exit status 2), else what is there. With --mark, also writes DIR/ready.json (the chart's
    bootstrap fill runs this after `specops bootstrap`). {LAYOUT}
    """
)

PUSH = prose(
    f"""
    Checks the models directory (as `specops models check`; a bad directory is refused before anything is
    uploaded), then uploads it with boto3 to S3_URI in the layout the Helm chart's S3 fill copies
    (models.fill.mode s3, models.fill.s3.uri S3_URI): S3_URI/target/..., S3_URI/draft/..., S3_URI/embedder/...,
    S3_URI/manifest.json, and last S3_URI/ready.json. The fill copies exactly the files ready.json lists and checks
    their sha256, so a fill that starts while a push is under way fails and is retried instead of copying a mix of
    two versions. Other keys under S3_URI are left alone and not copied. Credentials: the usual AWS environment
    variables, profile or instance identity. {LAYOUT}
    """
)


def add_parser(sub) -> None:
    models = add_group(
        sub,
        "models",
        help="check a models directory (target/, draft/, embedder/) and upload it to S3 for the Helm chart",
        description="A models directory, as serving, the trainer and `kb build` read it. " + LAYOUT,
    )
    p = models.add_parser(
        "check", help="check a models directory as serving loads it; --mark writes ready.json", description=CHECK
    )
    p.add_argument(
        "dir",
        nargs="?",
        default=str(models_dir()),
        help="models directory (default: %(default)s) (env: SPECOPS_DATA_DIR)",
    )
    _add_embedder_flag(p)
    p.add_argument("--mark", action="store_true", help="write DIR/ready.json once the checks pass")
    p.add_argument("--json", action="store_true", help="print the layout (the marker's fields) as JSON")
    p.set_defaults(func=cmd_models_check)
    p = models.add_parser(
        "push", help="check a models directory and upload it to s3://bucket/prefix, ready.json last", description=PUSH
    )
    p.add_argument("s3_uri", metavar="S3_URI", help="s3://bucket/prefix (what models.fill.s3.uri names)")
    p.add_argument(
        "--from",
        dest="src",
        default=str(models_dir()),
        metavar="DIR",
        help="models directory (default: %(default)s) (env: SPECOPS_DATA_DIR)",
    )
    p.add_argument(
        "--endpoint-url",
        default=None,
        help="S3 endpoint of a store other than AWS (MinIO, SeaweedFS, Ceph) (default: boto3's: AWS_ENDPOINT_URL)",
    )
    p.add_argument("--region", default=None, help="region (default: boto3's: AWS_DEFAULT_REGION, the profile)")
    _add_embedder_flag(p)
    p.set_defaults(func=cmd_models_push)


def _add_embedder_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-embedder",
        dest="embedder",
        action="store_false",
        help="a directory without embedder/ is complete (only the target router embedder routes, and `kb build` "
        "uses another embedder)",
    )


def cmd_models_check(args: argparse.Namespace) -> int:
    from specops.core.model_layout import check_models_dir, ready_marker, write_marker

    layout = check_models_dir(Path(args.dir), embedder=args.embedder)
    if args.json:
        print(json.dumps(ready_marker(layout, written_by="specops models check"), indent=1, sort_keys=True))
    else:
        print(
            f"{layout.root}: target/ and draft/ share one tokenizer (sha256 {layout.tokenizer_sha256[:12]}), "
            f"{'with' if layout.embedder else 'no'} embedder/, {len(layout.files)} files"
        )
    if args.mark:
        path = write_marker(layout.root, ready_marker(layout, written_by="specops models check --mark"))
        print(f"wrote {path}")
    return 0


def _split_s3(uri: str) -> tuple[str, str] | None:
    """(bucket, "prefix/" or "") of s3://bucket/prefix, None for anything else."""
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not parts.netloc:
        return None
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def cmd_models_push(args: argparse.Namespace) -> int:
    from specops.core.model_layout import READY_MARKER, check_models_dir, ready_marker

    where = _split_s3(args.s3_uri)
    if where is None:
        return fail("models push", f"S3_URI must be s3://bucket/prefix, got {args.s3_uri!r}")
    bucket, base = where
    layout = check_models_dir(Path(args.src), embedder=args.embedder)  # a bad directory stops here
    marker = ready_marker(layout, written_by="specops models push")
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError
    from tqdm import tqdm

    s3 = boto3.client("s3", endpoint_url=args.endpoint_url, region_name=args.region)
    total = sum(entry["size"] for entry in marker["files"].values())
    try:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base)
        before = {o["Key"] for page in pages for o in page.get("Contents", [])}
        with tqdm(total=total, unit="B", unit_scale=True, desc="upload", disable=None, file=sys.stderr) as bar:
            for rel in layout.files:
                s3.upload_file(str(layout.root / rel), bucket, base + rel, Callback=bar.update)
        body = (json.dumps(marker, indent=1, sort_keys=True) + "\n").encode()
        s3.put_object(Bucket=bucket, Key=base + READY_MARKER, Body=body, ContentType="application/json")
    except (BotoCoreError, ClientError) as exc:
        return fail("models push", f"s3://{bucket}/{base}: {exc} (nothing is complete there until ready.json is)")
    others = sorted(before - {base + rel for rel in layout.files} - {base + READY_MARKER})
    print(f"{len(layout.files)} files ({total / 1e6:.1f} MB) and {READY_MARKER} in s3://{bucket}/{base}")
    if others:
        print(f"{len(others)} other keys under it are left alone (the fill copies only what {READY_MARKER} lists)")
    print(
        f"the chart: models.fill.mode s3, models.fill.s3.uri s3://{bucket}/{base.rstrip('/')}"
        f"{'' if layout.embedder else ', models.fill.embedder false'}"
    )
    return 0
