"""The acceptance rules of speculative decoding (`speculative.py`), batched over requests on their device: the
speculative sampling rule that leaves the target distribution exact (Leviathan et al. 2023, Chen et al. 2023)
and its greedy form."""

from __future__ import annotations

import torch

from ...ops.sampling import inverse_cdf


def accept_drafts(
    target: torch.Tensor,
    draft: torch.Tensor,
    drafts: torch.Tensor,
    ks: torch.Tensor,
    u_accept: torch.Tensor,
    u_final: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative sampling rule for a batch of sampled requests' round, on their device.

    Args:
        target: [N, K+1, VOCAB] probabilities p_0 .. p_K (p_i: the target's distribution of the token after
            the i-th verified position; rows past a request's k + 1 unused); draft: [N, K, VOCAB] q_1 .. q_K,
            each d_i's draft distribution (rows past a request's k zero); drafts: [N, K] int64 drafted
            tokens; ks: [N] int64, each request's k <= K; u_accept: [N, K] and u_final: [N] fp64 uniforms.
    Returns:
        (accepted j [N] in [0, k], the round's last token [N]: drawn by inverse CDF with u_final from
        normalize(max(0, p_j - q_{j+1})) after a rejection, from p_k when all k were kept).
    """
    N, K = drafts.shape
    rows = torch.arange(N, device=target.device)
    if K:
        p_d = target[:, :K].gather(-1, drafts[:, :, None])[..., 0].double()
        q_d = draft.gather(-1, drafts[:, :, None])[..., 0].double()
        live = torch.arange(K, device=target.device)[None] < ks[:, None]
        keep = (u_accept * q_d < p_d) & live  # probability min(1, p(d) / q(d)); q(d) > 0 as d was drawn from q
        j = keep.long().cumprod(-1).sum(-1)
        q_j = torch.cat([draft, draft.new_zeros(N, 1, draft.shape[-1])], 1)[rows, j]  # zero at j = K
    else:
        j = torch.zeros(N, dtype=torch.long, device=target.device)
        q_j = torch.zeros_like(target[:, 0])
    p_j = target[rows, j]
    residual = (p_j - q_j).clamp_min(0)
    empty = ~(residual.sum(-1) > 0)  # p == q to rounding: nothing to correct
    residual = torch.where(empty[:, None], p_j, residual)
    return j, inverse_cdf(residual, u_final)


def accept_greedy(
    target_logits: torch.Tensor, drafts: torch.Tensor, ks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule at temperature 0, batched: target_logits [N, K+1, VOCAB], drafts [N, K], ks [N]; drafts are
    kept while each equals the target's argmax (the first one, as the sampler takes it); the round ends with
    the target's argmax."""
    N, K = drafts.shape
    best = target_logits.float().argmax(-1)  # [N, K+1]
    live = torch.arange(K, device=drafts.device)[None] < ks[:, None]
    j = ((drafts == best[:, :K]) & live).long().cumprod(-1).sum(-1)
    return j, best[torch.arange(N, device=drafts.device), j]


__all__ = ["accept_drafts", "accept_greedy"]
