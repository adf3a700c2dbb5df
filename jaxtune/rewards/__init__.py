"""GRPO's rewards (`rl.rewards`): functions that score each sampled completion against its row.

`load_rewards(specs, weights)` resolves every spec up front (`loading`): the built-ins
`exact_answer`, `exact_answer:MARKER` and `format:REGEX` (`builtin`), or a user's
`package.module:function`. `Rewards.score` calls each on a batch and checks what it returns,
`Rewards.total` weighs and sums them (`scoring`), and `Rewards.identity()` is what a cache key
hashes: a user's reward by the source of its module, a built-in by its spec (its code is
jaxtune's, which the stage's code digest covers).

May import: jaxtune.config, jaxtune.errors
"""

from jaxtune.rewards.builtin import RewardFunction, answer_matches
from jaxtune.rewards.loading import load_reward, load_rewards
from jaxtune.rewards.scoring import BUILTIN, Reward, Rewards

__all__ = ["BUILTIN", "Reward", "RewardFunction", "Rewards", "answer_matches", "load_reward", "load_rewards"]
