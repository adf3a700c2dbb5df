"""How far two AdamW runs from the same weights can end apart when their gradients differ only by
float32 summation order: a bound per element, from the one-device run's Adam moments step by step.

AdamW's step t moves a weight by -lr_t * (u_t + wd * w), with u_t = m_t / (sqrt(v_t) + eps), where
m_t and v_t are the bias-corrected moments: weighted sums of the gradients g_1..g_t with weights
a_s = (1 - b1) b1^(t-s) / (1 - b1^t) for m and c_s = (1 - b2) b2^(t-s) / (1 - b2^t) for v, each
summing to 1. For two gradient histories g, g' with |g_s - g'_s| <= D_s:

- |m - m'| <= sum_s a_s D_s (m is linear);
- |sqrt(v) - sqrt(v')| <= sqrt(sum_s c_s D_s^2) (sqrt(v) is a weighted 2-norm of the history);
- |m| / sqrt(v) <= B_t = sqrt(sum_s a_s^2 / c_s) (Cauchy-Schwarz), so |u| <= B_t whatever the gradients;
- so |u - u'| <= |m - m'| / (sqrt(v) + eps) + B_t |sqrt(v) - sqrt(v')| / (sqrt(v) + eps), with v
  the reference run's, and never more than 2 B_t (opposite signs, each at the most).

Weight decay (TrainConfig's 0.01) multiplies a difference by 1 - lr wd < 1, so the weights end
apart by at most sum_t lr_t |u_t - u'_t|, plus float32's rounding in each run: of u_t (a few
operations, under 4 ulps of |u_t| <= B_t) and of each step's new weight (half an ulp of it). An
element whose moments are large against D moves alike in both runs; one whose gradient is as
small as float32's noise (a gradient that cancels to ~1e-7, comparable to eps) can move by up to
2 B_t lr_t a step whatever its sign.

D_s is the one assumption: each gradient element differs by at most RHO times the RMS of its
tensor's gradient at that step (float32 sums in another order, over weights that already differ
by as little; gradient clipping's factor differs by a few ulps, far less).
"""

from __future__ import annotations

import numpy as np

B1, B2, EPS = 0.9, 0.999, 1e-8  # optax.adamw's defaults, which steps.make_optimizer uses
F32_ULP = 2.0**-23  # float32's relative spacing: rounding to nearest is within half of it

# The largest gradient difference seen between a mesh and one device, per tensor and step, over
# the five meshes, both methods and every step (gradients recovered from the Adam moments as
# (m_t - b1 m_(t-1)) / (1 - b1), their own float32 rounding included): 3.8e-5 of the tensor's RMS
# gradient (LoRA A on tensor=8; full fine-tuning's largest, lm_head on 2x2x2: 3.5e-5). RHO = 1e-3
# leaves 26x for other CPUs' kernels and summation orders; a wrong split moves gradients by far more
# (of order the gradient itself, RHO = 1).
RHO = 1e-3


def gradients(moments: dict[str, np.ndarray], name: str, steps: int) -> list[np.ndarray]:
    """The clipped gradients g_1..g_steps of weight `name`, from its first moments after each step
    ("step-t/mu/NAME"): m_t = b1 m_(t-1) + (1 - b1) g_t."""
    found, previous = [], 0.0
    for t in range(1, steps + 1):
        mu = moments[f"step-{t}/mu/{name}"].astype(np.float64)
        found.append((mu - B1 * previous) / (1 - B1))
        previous = mu
    return found


def moment_weights(t: int) -> tuple[np.ndarray, np.ndarray]:
    """(a_s, c_s) for s = 1..t: what each step's gradient weighs in the bias-corrected m_t and v_t."""
    s = np.arange(1, t + 1)
    return (1 - B1) * B1 ** (t - s) / (1 - B1**t), (1 - B2) * B2 ** (t - s) / (1 - B2**t)


def direction_bound(t: int) -> float:
    """B_t: the most |m_t| / sqrt(v_t) can be after t steps, whatever the gradients (1.011 at t = 5)."""
    a, c = moment_weights(t)
    return float(np.sqrt(np.sum(a**2 / c)))


def weight_bound(reference: dict[str, np.ndarray], name: str, lrs: list[float], rho: float = RHO) -> np.ndarray:
    """Per element of weight `name`, the most the weight can differ after len(lrs) steps from the
    reference run's (its "NAME", "initial/NAME" and "step-t/{mu,nu}/NAME"), gradients apart by
    `rho` times their tensor's RMS at each step."""
    steps = len(lrs)
    apart = [rho * np.sqrt(np.mean(g**2)) for g in gradients(reference, name, steps)]  # D_s, per tensor
    total = np.zeros(reference[name].shape)
    for t, lr in enumerate(lrs, 1):
        a, c = moment_weights(t)
        d_m = float(np.sum(a * apart[:t]))
        d_v = float(np.sqrt(np.sum(c * np.square(apart[:t]))))
        b = direction_bound(t)
        root_v = np.sqrt(reference[f"step-{t}/nu/{name}"].astype(np.float64) / (1 - B2**t))
        total += lr * (np.minimum(2 * b, (d_m + b * d_v) / (root_v + EPS)) + 2 * 4 * F32_ULP * b)
    largest = np.maximum(np.abs(reference[name]), np.abs(reference[f"initial/{name}"])) + total
    return total + steps * F32_ULP * largest  # each run's new weight rounds to half an ulp: one ulp for the pair
