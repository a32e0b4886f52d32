"""Code-free snapshots of in-session state (optimizer, plugins, random generators).

A resumable checkpoint must hold whatever a session mutates while it trains:
optimizer moments, a mean teacher, gradient buffers, counters, random
generators. Pickle would store all of it and could also run code when loaded,
so it is never used. Instead :func:`pack` turns nested data (dicts, lists,
tuples, numbers, strings, tensors) into a JSON skeleton plus named tensors for
safetensors, and :func:`capture` / :func:`restore` do the same for plugin
attributes, recognising the stateful objects plugins hold (modules, torch and
numpy generators, MONAI random transforms, data loaders and batch streams,
dataclasses).

Restoring writes *into* the objects a freshly set-up session already holds
(the resumed session repeats its deterministic set-up first), so references
between objects survive; attributes that are neither data nor one of those
objects (datasets, iterators, callables) are rebuilt by the session itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

#: marker for values a snapshot leaves out
SKIP = object()


# ------------------------------------------------------------------------------------------------ plain nested data


def pack(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able skeleton of ``obj``; its tensors go to ``tensors`` under keys starting with ``prefix``."""
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}#{len(tensors)}"
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {"t": key}
    if isinstance(obj, np.ndarray):
        key = f"{prefix}#{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"a": key}
    if isinstance(obj, dict):
        return {"d": [[pack(k, prefix, tensors), pack(v, prefix, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "u": [pack(v, prefix, tensors) for v in obj]}
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot snapshot a {type(obj).__name__}")


def unpack(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`pack`."""
    if isinstance(skeleton, dict):
        if "t" in skeleton:
            return tensors[skeleton["t"]]
        if "a" in skeleton:
            return tensors[skeleton["a"]].numpy()
        if "d" in skeleton:
            return {_hashable(unpack(k, tensors)): unpack(v, tensors) for k, v in skeleton["d"]}
        if "l" in skeleton:
            return [unpack(v, tensors) for v in skeleton["l"]]
        if "u" in skeleton:
            return tuple(unpack(v, tensors) for v in skeleton["u"])
    return skeleton


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


# ------------------------------------------------------------------------------------------------ stateful objects


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's state dict plus its non-persistent buffers (e.g. GAS's gradient buffer)."""
    state = dict(module.state_dict())
    for name, buf in module.named_buffers():
        state.setdefault(name, buf)
    return state


@torch.no_grad()
def load_module_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`module_state` (shapes must match)."""
    persistent = module.state_dict()
    module.load_state_dict({k: v for k, v in state.items() if k in persistent})
    for name, value in state.items():
        if name not in persistent:
            module.get_buffer(name).copy_(value)


def _randomizables(transform: Any) -> list:
    """A MONAI transform and every transform nested in it, in a stable order."""
    out = [transform]
    for child in getattr(transform, "transforms", ()) or ():
        out += _randomizables(child)
    return out


def capture(value: Any) -> Any:
    """A snapshot of one attribute value (:data:`SKIP` for things a session rebuilds itself)."""
    from monai.transforms import Randomizable
    from torch.utils.data import DataLoader

    from jascl.data.datasets import BatchStream

    if isinstance(value, (torch.Tensor, np.ndarray)) or value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    if isinstance(value, nn.Module):
        return {"module": module_state(value)}
    if isinstance(value, torch.Generator):
        return {"generator": value.get_state()}
    if isinstance(value, np.random.Generator):
        return {"np_generator": value.bit_generator.state}
    if isinstance(value, np.random.RandomState):
        return {"random_state": list(value.get_state())}
    if isinstance(value, Randomizable):
        return {
            "monai": [
                list(t.R.get_state()) if isinstance(getattr(t, "R", None), np.random.RandomState) else None
                for t in _randomizables(value)
            ]
        }
    if isinstance(value, BatchStream):
        return {"stream": value.state_dict()}
    if isinstance(value, DataLoader):
        sampler = value.batch_sampler
        return {
            "loader": {
                "generator": value.generator.get_state() if value.generator is not None else None,
                "sampler": getattr(sampler, "state_dict", lambda: None)(),
            }
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: capture(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"dataclass": {k: v for k, v in fields.items() if v is not SKIP}}
    if isinstance(value, dict):
        items = [(k, capture(v)) for k, v in value.items()]
        if all(isinstance(k, (str, int)) for k, _ in items):
            return {"dict": [[k, v] for k, v in items if v is not SKIP]}
        return SKIP
    if isinstance(value, (list, tuple)):
        items = [capture(v) for v in value]
        return SKIP if any(v is SKIP for v in items) else {"list" if isinstance(value, list) else "tuple": items}
    return SKIP


@torch.no_grad()
def restore(current: Any, snap: Any) -> Any:
    """The attribute value for ``snap``, written into ``current`` where it is a stateful object."""
    kind, data = next(iter(snap.items()))
    if kind == "v":
        if isinstance(data, torch.Tensor) and isinstance(current, torch.Tensor):
            if current.shape == data.shape and current.dtype == data.dtype:
                return current.copy_(data)
            return data.to(current.device)
        return data
    if kind == "module":
        load_module_state(current, data)
        return current
    if kind == "generator":
        current.set_state(data)
        return current
    if kind == "np_generator":
        current.bit_generator.state = data
        return current
    if kind == "random_state":
        current.set_state(tuple(data))
        return current
    if kind == "monai":
        for t, s in zip(_randomizables(current), data):
            if s is not None:
                t.R.set_state(tuple(s))
        return current
    if kind == "stream":  # written into the stream the session set up (none set up: nothing to continue)
        if current is not None and hasattr(current, "load_state_dict"):
            current.load_state_dict(data)
        return current
    if kind == "loader":  # a loader the session rebuilt differently (e.g. per phase) is left as it is
        if data["generator"] is not None and getattr(current, "generator", None) is not None:
            current.generator.set_state(data["generator"])
        if data["sampler"] is not None and hasattr(getattr(current, "batch_sampler", None), "load_state_dict"):
            current.batch_sampler.load_state_dict(data["sampler"])
        return current
    if kind == "dataclass":
        for name, value in data.items():
            setattr(current, name, restore(getattr(current, name), value))
        return current
    if kind == "dict":
        before = current if isinstance(current, dict) else {}
        return {k: restore(before.get(k), v) for k, v in data}
    if kind in ("list", "tuple"):
        earlier = list(current) if isinstance(current, (list, tuple)) else []
        items = [restore(earlier[i] if i < len(earlier) else None, v) for i, v in enumerate(data)]
        return items if kind == "list" else tuple(items)
    raise ValueError(f"unknown snapshot entry {kind!r}")


def capture_object(obj: Any, exclude: tuple[str, ...] = ()) -> dict:
    """Snapshot of every data-like attribute of ``obj`` (a plugin), except the names in ``exclude``."""
    out = {}
    for name, value in vars(obj).items():
        if name in exclude:
            continue
        snap = capture(value)
        if snap is not SKIP:
            out[name] = snap
    return out


def restore_object(obj: Any, snapshot: dict) -> None:
    """Write a :func:`capture_object` snapshot back into ``obj``."""
    for name, snap in snapshot.items():
        setattr(obj, name, restore(getattr(obj, name, None), snap))


# ------------------------------------------------------------------------------------------------ random generators


def rng_state() -> dict:
    """The global random states a session draws from (torch CPU and current CUDA device, numpy, Python)."""
    import random

    state = {"torch": torch.get_rng_state(), "numpy": list(np.random.get_state()), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random

    torch.set_rng_state(state["torch"])
    np.random.set_state(tuple(state["numpy"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
