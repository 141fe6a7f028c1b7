"""vLLM worker extension: load a new draft's weights into a running server's drafter, in place.

``--worker-extension-cls specops_vllm_reload.DraftReload`` mixes :class:`DraftReload` into
vLLM's worker; the front door then calls ``specops_reload_draft`` through vLLM's
``POST /collective_rpc`` (a development endpoint: ``VLLM_SERVER_DEV_MODE=1``, which our
servers only ever bind on 127.0.0.1). The engine runs the call between two steps, so requests
in flight pause for the load and go on with the new draft; the target never changes, so every
output stays the target's.

The load is vLLM's own in-place reload (``model_loader.reload.reload_weights``): each layer
is loaded in checkpoint format and processed again as at start-up (the CPU's packed GEMM
weights included), then copied into the tensors the engine already holds. It is refused
before anything is touched when the new checkpoint's tensors do not match the running
drafter's names and shapes (a different architecture needs a new server).

Runs inside the vLLM venv: only vLLM, torch and safetensors are imported, and only here.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import time


class DraftReload:
    """Mixed into vLLM's worker (``self`` is the worker: ``get_draft_model``, ``vllm_config``)."""

    def specops_reload_draft(self, path: str) -> str:
        import torch
        from safetensors import safe_open
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        t0 = time.monotonic()
        model = self.get_draft_model()
        spec = self.vllm_config.speculative_config
        if model is None or spec is None or spec.draft_model_config is None:
            raise RuntimeError("this vLLM server runs no draft model")
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}")
        tensors: list[tuple[str, torch.Tensor]] = []
        for f in files:
            with safe_open(f, framework="pt") as st:
                tensors += [(name, st.get_tensor(name)) for name in st.keys()]
        for name, t in tensors:
            if not torch.is_floating_point(t) or not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: not finite floating-point numbers")
        # a checkpoint of the running drafter's shape: the config's sizes must be the running ones
        with open(os.path.join(path, "config.json")) as fh:
            new_cfg = json.load(fh)
        running = spec.draft_model_config.hf_config.to_dict()
        for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "head_dim", "tie_word_embeddings"):  # fmt: skip
            if key in running and new_cfg.get(key, running[key]) != running[key]:
                raise ValueError(f"config.json {key}={new_cfg.get(key)!r}, the running draft has {running[key]!r}")
        cfg = copy.copy(self.vllm_config)
        cfg.model_config = spec.draft_model_config  # the drafter's own config (quantization, dtype)
        vocab = getattr(model, "specops_load_vocab", None)  # a drafter over its own vocabulary (specops_vllm_vocab)
        if vocab is not None and not os.path.isfile(os.path.join(path, "draft_vocab.json")):
            raise ValueError(f"{path} has no draft_vocab.json; the running drafter scores its own vocabulary")
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            reload_weights(cfg, model, weights_iterator=iter(tensors), weights_path=None, is_checkpoint_format=True)
            size = vocab(path) if vocab is not None else None  # the new draft's ids, its head's rows
        out = {"tensors": len(tensors), "seconds": round(time.monotonic() - t0, 3), "path": path, "vocab": size}
        return json.dumps(out)
