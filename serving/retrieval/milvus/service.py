"""The connection to a Milvus service for ``specops.serving.retrieval.milvus.kb``: the URI rules, the
process's one client per (URI, token), and calls whose failures name the URI and collection.

A URI is a Milvus Lite path ending in ``.db`` (embedded: pymilvus starts an in-process server
for it; one process at a time holds it) or a server's ``http(s)://host:port`` (a Milvus
server, or ``milvus-lite server``). Serving reaches the service at its deployment's address:
``SPECOPS_MILVUS_URI`` and ``SPECOPS_MILVUS_TOKEN`` (read by ``milvus.MilvusKB.from_manifest``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from specops.core.errors import KBError, UnavailableError

URI_ENV, TOKEN_ENV = "SPECOPS_MILVUS_URI", "SPECOPS_MILVUS_TOKEN"
CONNECT_TIMEOUT_S, CALL_TIMEOUT_S = 10.0, 30.0


def is_lite(uri: str) -> bool:
    """A Milvus Lite path (anything that is not an http(s)://, tcp:// or unix: address)."""
    return not uri.startswith(("http://", "https://", "tcp://", "unix:"))


def normalize_uri(uri: str) -> str:
    """``uri`` as recorded and keyed: a Lite path made absolute (it must end in ``.db``)."""
    uri = str(uri).strip()
    if not is_lite(uri):
        return uri
    if not uri.endswith(".db"):
        raise KBError(f"Milvus URI {uri!r}: a Milvus Lite path ending in .db, or http://host:port of a server")
    return str(Path(uri).expanduser().resolve())


_CLIENTS: dict[tuple[str, str], object] = {}
_CLIENTS_LOCK = threading.Lock()


def client_for(uri: str, token: str = "", *, create: bool = False):
    """The process's one MilvusClient for (``uri``, ``token``). A Lite path that does not exist
    is refused unless ``create`` (a build): loading never makes an empty database."""
    from pymilvus import MilvusClient
    from pymilvus.exceptions import MilvusException

    uri = normalize_uri(uri)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get((uri, token))
        if client is not None:
            return client
        if is_lite(uri):
            if create:
                Path(uri).parent.mkdir(parents=True, exist_ok=True)
            elif not Path(uri).exists():
                raise KBError(
                    f"no Milvus Lite database at {uri}: build the KB there, or set {URI_ENV} to the Milvus "
                    "service that holds its collection"
                )
        try:
            client = MilvusClient(uri=uri, token=token, timeout=CONNECT_TIMEOUT_S)
        except MilvusException as exc:
            if is_lite(uri):
                raise KBError(
                    f"cannot open the Milvus Lite database {uri} ({exc.message}). Milvus Lite serves one process "
                    f"at a time: to share it, run `milvus-lite server --data-dir {uri} --port 19530` and set "
                    f"{URI_ENV}=http://127.0.0.1:19530"
                ) from exc
            raise KBError(
                f"cannot reach the Milvus service at {uri} ({exc.message}): start it, or set {URI_ENV} "
                f"(and {TOKEN_ENV}) to this deployment's service"
            ) from exc
        _CLIENTS[(uri, token)] = client
        return client


class Service:
    """One collection behind the process's client; a failed call names the URI and collection."""

    def __init__(self, uri: str, token: str, collection: str, *, create: bool = False) -> None:
        self.uri, self.collection = normalize_uri(uri), collection
        self.client = client_for(self.uri, token, create=create)

    def call(self, method: str, *args, error: type[Exception] = UnavailableError, **kwargs):
        from pymilvus.exceptions import MilvusException

        try:
            return getattr(self.client, method)(*args, timeout=CALL_TIMEOUT_S, **kwargs)
        except MilvusException as exc:
            raise error(
                f"Milvus {method} on collection {self.collection!r} at {self.uri} failed: {exc.message}"
            ) from exc

    def vectors(self, ids: list[int], dims: int) -> dict[int, np.ndarray]:
        """The float16 vectors of ``ids`` (distinct), in one ``get``."""
        if not ids:
            return {}
        rows = self.call("get", self.collection, ids=ids, output_fields=["vector"])
        got = {int(r["id"]): r["vector"] for r in rows}
        missing = sorted(set(ids) - set(got))
        if missing:
            raise KBError(f"collection {self.collection!r} lacks passages {missing[:8]}: modified after its build")
        keys = list(got)
        return dict(zip(keys, as_f16(np.asarray([got[i] for i in keys], dtype=np.float32), dims, self.collection)))


def as_f16(vectors: np.ndarray, dims: int, collection: str) -> np.ndarray:
    """[c, dims] float32 from Milvus as float16, refusing values a KB never stores."""
    if vectors.ndim != 2 or vectors.shape[1] != dims:
        raise KBError(f"collection {collection!r} returned vectors of shape {vectors.shape}, expected [*, {dims}]")
    f16 = vectors.astype(np.float16)
    if not (f16.astype(np.float32) == vectors).all():
        raise KBError(f"collection {collection!r} holds vectors that are not float16 values: not a specops build")
    return f16
