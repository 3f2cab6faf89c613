"""Ulysses sequence parallelism, the engine side: slice a packed row over the ranks of an SP group,
run the model and the log-prob head on this rank's tokens, gather the per-token results.

The group type and the all-to-all exchanges the model's token mixers make are `models/parallel.py`
(`UlyssesGroup`); the model stores the group through `MoeCausalLM.set_sequence_parallel(group)`.
`packed_log_probs` makes every rank of the group compute the same loss.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from verl_moe.engines.core import LogProbModel, PackedBatch
from verl_moe.models.parallel import UlyssesGroup


def slice_packed(packed: PackedBatch, sp: UlyssesGroup) -> tuple[PackedBatch, int]:
    """This rank's T/sp tokens of a packed row, padded to a multiple of sp, and the pad size.

    input_ids, position_ids, labels, temperature are sliced; cu_seqlens stays global (the
    sequence ops run on whole sequences after `seq_to_heads`) with the pad as one more sequence.
    """
    total = packed.num_tokens
    pad = -total % sp.size
    ids, pos = packed.input_ids, packed.position_ids
    labels, temperature, cu = packed.labels, packed.temperature, packed.cu_seqlens
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad))
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device)[None]], dim=1)
        labels = torch.nn.functional.pad(labels, (0, pad))
        temperature = torch.nn.functional.pad(temperature, (0, pad), value=1.0)
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
    local = slice(sp.rank * (total + pad) // sp.size, (sp.rank + 1) * (total + pad) // sp.size)
    return (
        replace(
            packed,
            input_ids=ids[:, local],
            position_ids=pos[:, local],
            labels=labels[local],
            temperature=temperature[local],
            cu_seqlens=cu,
        ),
        pad,
    )


def packed_log_probs(
    module: LogProbModel, packed: PackedBatch, sp: UlyssesGroup | None, calculate_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`module` (the spec + log-prob head) over a whole packed row: (log_probs [T], entropy [T] or
    None), fp32. Under SP each rank runs its slice (`slice_packed`) and every rank gets all T
    values back (`gather_tokens`), so the loss sees the micro-batch exactly as without SP."""
    if sp is None:
        return module(packed, calculate_entropy, entropy_grad)
    local, pad = slice_packed(packed, sp)
    log_probs, entropy = module(local, calculate_entropy, entropy_grad)
    return sp.gather_tokens(log_probs, pad), None if entropy is None else sp.gather_tokens(entropy, pad)
