"""The logit lens: what a GPT would predict if it stopped after each layer.

The residual stream after the embeddings and after every block is passed through the model's own
final norm and output head (and its logit soft-cap), as the last block's output is in the forward
pass. Row 0 is the embeddings alone (a bigram guess), row ``n_layers`` is the model's prediction:
the same tensors through the same modules, so it equals ``model(ids)``'s logits (tested).

The streams are captured with forward hooks on the blocks during one ordinary forward pass, so the
lens reads the model as it runs (any position scheme, norm or attention implementation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinylm.errors import TinyLMError
from tinylm.models.gpt import eval_mode


@dataclass
class LensGrid:
    """Layer rows x position columns. Column t predicts the token after ``ids[t]``."""

    ids: list[int]  # the positions' tokens (the start token first, when the tokenizer has one)
    layers: list[str]  # row names: "embeddings", "layer 1", ..., "layer N"
    top_ids: list[list[list[int]]]  # [row][position][k]: the k most likely next tokens, most likely first
    top_probs: list[list[list[float]]]  # their probabilities
    next_probs: list[list[float | None]]  # [row][position]: p(ids[t + 1]) at that row; None at the last position
    logits: torch.Tensor  # (rows, positions, vocab): every row's logits, for callers that need more than the top


def check_layered(model) -> torch.nn.ModuleList:
    """The model's blocks, or a TinyLMError for a model the lens cannot read (no layers)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or not hasattr(model, "norm_f") or not hasattr(model, "lm_head"):
        raise TinyLMError(
            f"the logit lens needs a transformer with layers (a GPT); this model is a "
            f"{type(model).__name__}, which has none"
        )
    return blocks


def layer_streams(model, idx: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the residual stream entering block 0 and leaving each block, each (B, T, C); the model's logits)."""
    blocks = check_layered(model)
    streams: list[torch.Tensor] = []
    hooks = [blocks[0].register_forward_pre_hook(lambda _module, args: streams.append(args[0]))]
    hooks += [block.register_forward_hook(lambda _module, _args, out: streams.append(out)) for block in blocks]
    try:
        logits, _ = model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return streams, logits


def logit_lens(model, ids: list[int], top: int = 5) -> LensGrid:
    """The lens over ``ids`` (at most the model's context length), with each cell's ``top`` tokens."""
    check_layered(model)
    if not ids:
        raise TinyLMError("the logit lens needs at least one token")
    context = model.config.context_length
    if len(ids) > context:
        raise TinyLMError(f"{len(ids)} tokens do not fit the model's context of {context}")
    if top < 1:
        raise TinyLMError(f"top must be >= 1 (got {top})")
    with torch.inference_mode(), eval_mode(model):
        streams, _ = layer_streams(model, torch.tensor([ids], device=model.lm_head.weight.device))
        logits = torch.stack([model.read_out(s)[0] for s in streams]).float()  # (rows, T, V)
    logp = torch.log_softmax(logits, dim=-1)
    values, top_ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    following = torch.tensor(ids[1:], dtype=torch.long)
    next_p = logp[:, :-1].gather(-1, following[None, :, None].expand(len(streams), -1, 1))[..., 0].exp()
    return LensGrid(
        ids=list(ids),
        layers=["embeddings"] + [f"layer {i + 1}" for i in range(len(streams) - 1)],
        top_ids=top_ids.tolist(),
        top_probs=values.exp().tolist(),
        next_probs=[row + [None] for row in next_p.tolist()],
        logits=logits,
    )
