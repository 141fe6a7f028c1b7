"""A small stand-in for pydantic on the GPU machine, which has none (``benchmarks.gpu_compat``).

The CUDA path imports :mod:`specops.serving.proposers.catalogue`, whose methods' request options
are pydantic models (``MethodOptions``: defaults, numeric bounds, an ``after`` validator, extra
fields refused, frozen). This stand-in gives exactly that much: ``BaseModel`` with
``model_fields``, ``model_validate``, ``model_dump`` and ``model_json_schema``; ``Field`` with
``ge``/``gt``/``le``/``lt``; ``ConfigDict``; ``model_validator(mode="after")``; and
``ValidationError`` with ``errors()``. Nothing else in the CUDA check uses pydantic; where
pydantic is installed it is always used instead.
"""

from __future__ import annotations

import types
from typing import Any

_BOUNDS = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b, "lt": lambda v, b: v < b}


class FieldInfo:
    def __init__(self, default: Any = None, **kw: Any) -> None:
        self.default = default
        self.bounds = {k: v for k, v in kw.items() if k in _BOUNDS and v is not None}
        self.description = kw.get("description")


def Field(default: Any = None, **kw: Any) -> FieldInfo:  # noqa: N802  (pydantic's name)
    return FieldInfo(default, **kw)


def ConfigDict(**kw: Any) -> dict:  # noqa: N802
    return dict(kw)


class ValidationError(ValueError):
    def __init__(self, items: list[dict]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in items))
        self._items = items

    def errors(self) -> list[dict]:
        return list(self._items)


def model_validator(*, mode: str = "after"):
    assert mode == "after", "only mode='after' validators are stood in for"

    def mark(fn):
        fn.__gpu_pydantic_after__ = True
        return fn

    return mark


class BaseModel:
    model_fields: dict[str, FieldInfo] = {}
    _validators: tuple = ()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        fields = dict(getattr(cls, "model_fields", {}))
        for name in cls.__dict__.get("__annotations__", {}):
            if name.startswith("_") or name in ("model_config", "model_fields"):
                continue
            value = cls.__dict__.get(name)
            fields[name] = value if isinstance(value, FieldInfo) else FieldInfo(value)
        cls.model_fields = fields
        validators = [f for f in cls.__dict__.values() if getattr(f, "__gpu_pydantic_after__", False)]
        cls._validators = (*getattr(cls, "_validators", ()), *validators)

    def __init__(self, **given: Any) -> None:
        errors = [{"loc": (k,), "msg": "Extra inputs are not permitted"} for k in given if k not in self.model_fields]
        for name, info in self.model_fields.items():
            value = given.get(name, info.default)
            for bound, limit in info.bounds.items():
                if not _BOUNDS[bound](value, limit):
                    errors.append({"loc": (name,), "msg": f"Input should be {bound} {limit}"})
            object.__setattr__(self, name, value)
        if errors:
            raise ValidationError(errors)
        for validator in self._validators:
            try:
                validator(self)
            except ValueError as exc:
                raise ValidationError([{"loc": (), "msg": str(exc), "ctx": {"error": exc}}]) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is frozen")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    def __hash__(self) -> int:
        return hash((type(self), tuple(self.model_dump().items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.model_dump().items())})"

    @classmethod
    def model_validate(cls, data: dict) -> BaseModel:
        return cls(**dict(data))

    def model_dump(self) -> dict:
        return {name: getattr(self, name) for name in self.model_fields}

    @classmethod
    def model_json_schema(cls) -> dict:
        return {
            "properties": {n: {"default": f.default, "description": f.description} for n, f in cls.model_fields.items()}
        }


def module() -> types.ModuleType:
    """The stand-in as a module for ``sys.modules['pydantic']``."""
    mod = types.ModuleType("pydantic", __doc__)
    for name in ("BaseModel", "Field", "FieldInfo", "ConfigDict", "ValidationError", "model_validator"):
        setattr(mod, name, globals()[name])
    return mod
