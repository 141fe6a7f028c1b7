"""Copy a model directory from S3 into the models volume: s3://bucket/prefix/{target,draft,...} -> MODELS_OUT.

The copy is written to a temporary sibling of MODELS_OUT and renamed into place, so serving (which waits for
MODELS_OUT/target/config.json) never sees half a directory. A MODELS_OUT that already has target/config.json is
kept unless MODELS_FORCE is "true". Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the pod's identity.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import boto3

uri = urlsplit(os.environ["MODELS_S3_URI"])
if uri.scheme != "s3" or not uri.netloc:
    sys.exit(f"MODELS_S3_URI must be s3://bucket/prefix, got {os.environ['MODELS_S3_URI']!r}")
bucket, prefix = uri.netloc, uri.path.strip("/")
base = f"{prefix}/" if prefix else ""
out = Path(os.environ["MODELS_OUT"])
if (out / "target" / "config.json").is_file() and os.environ.get("MODELS_FORCE") != "true":
    print(f"{out}/target/config.json is there: kept (models.fill.force replaces it)", flush=True)
    sys.exit(0)

s3 = boto3.client(
    "s3",
    endpoint_url=os.environ.get("MODELS_S3_ENDPOINT") or None,
    region_name=os.environ.get("MODELS_S3_REGION") or None,
)
objects = [
    (o["Key"], o["Key"][len(base) :])
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base)
    for o in page.get("Contents", [])
    if not o["Key"].endswith("/")
]
names = {rel for _, rel in objects}
if "target/config.json" not in names:
    sys.exit(f"s3://{bucket}/{base} has no target/config.json: a model directory holds target/ and draft/ (HF layout)")
if "draft/config.json" not in names:
    sys.exit(f"s3://{bucket}/{base} has no draft/config.json: the base draft (the target's tokenizer) goes in draft/")

out.parent.mkdir(parents=True, exist_ok=True)
tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
try:
    for key, rel in objects:
        dest = (tmp / rel).resolve()
        if not dest.is_relative_to(tmp.resolve()):
            sys.exit(f"refusing {key}: it would land outside {out}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, key, str(dest))
        print(f"s3://{bucket}/{key} -> {out / rel}", flush=True)
    tmp.chmod(0o755)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
print(f"{len(objects)} files in {out}", flush=True)
