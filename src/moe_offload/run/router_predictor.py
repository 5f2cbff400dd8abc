"""The look-ahead's default predictor: layer t's experts guessed by layer t's own router on an earlier layer's
output (Mixtral-offloading's predictor, the one that needs no training).

Layer t's router is applied to the earlier hidden state after layer t's post-attention norm (the router's input
is that norm of a residual stream a layer later). `predict_ids` only queues the work on the device and returns
the ids [T, k] there; `predict` reads them to the host, in the router's order (most likely first), each once.
A layer whose norm or router weights are on the disk tier (meta placeholders until its own hook reads them) is
not covered.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..model.inventory import layer_of, layer_prefix


class RouterPredictor:
    """Layer t's experts predicted by layer t's router on an earlier layer's output hidden state."""

    def __init__(self, model: nn.Module):
        self._layers: dict[int, tuple[nn.Module, nn.Module]] = {}   # layer -> (post-attention norm, router)
        for name, mod in model.named_modules():
            if layer_prefix(name) != name:   # decoder layers only
                continue
            layer = layer_of(name)
            mlp = getattr(mod, "mlp", None)
            norm = getattr(mod, "post_attention_layernorm", None)
            router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
            if isinstance(norm, nn.Module) and isinstance(router, nn.Module) and _readable(norm, router):
                self._layers[layer] = (norm, router)

    def covers(self, layer: int) -> bool:
        return layer in self._layers

    @torch.no_grad()
    def predict_ids(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The router's top-k ids [T, k] for `layer` from `hidden`, on the device: queued, not read."""
        if layer not in self._layers:
            return None
        norm, router = self._layers[layer]
        out = router(norm(hidden).reshape(-1, hidden.shape[-1]))
        return next((t for t in (out if isinstance(out, tuple) else (out,))[::-1]
                     if isinstance(t, torch.Tensor) and not t.is_floating_point()), None)

    def predict(self, layer: int, hidden: torch.Tensor) -> list[int] | None:
        """predict_ids read to the host: the router's top-k order, most likely first, each id once."""
        return ids_in_order(self.predict_ids(layer, hidden))


def ids_in_order(ids: torch.Tensor | None) -> list[int] | None:
    """Predicted ids [T, k] as a host list in the router's order (a look-ahead reads them in this order), once each."""
    return None if ids is None else list(dict.fromkeys(ids.reshape(-1).tolist()))


def _readable(*mods: nn.Module) -> bool:
    # A router or norm whose weights are on the disk tier is a meta placeholder until its layer's hook reads it.
    return all(p.device.type != "meta" for m in mods for p in m.parameters())
