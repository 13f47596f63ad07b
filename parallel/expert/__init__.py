"""Expert parallelism: a MoE's routed experts split over ep ranks of the data-parallel group.

dispatch.py sends each routed token to the rank holding its expert and back (all-to-alls over uneven splits);
gradients.py averages the experts' gradients over the ranks holding the same experts and hands them to the
optimizer beside ZeRO's. What is exchanged is job/exchange/experts.py's description, which the simulator prices.
"""

EXPERT_MARK = "_minigpt_expert_shard"  # set on a parameter expert parallelism holds apart from ZeRO's flat buffers


def is_expert_shard(param) -> bool:
    """Whether `param` is a rank's slice of routed experts, reduced over its own group (not by ZeRO)."""
    return getattr(param, EXPERT_MARK, False)
