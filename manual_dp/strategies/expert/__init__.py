"""Expert parallelism (GShard, Megatron's EP, torchtitan's expert_parallel_degree): an MoE's E experts
sharded over a group of N contexts, E/N a context; every other parameter replicated as in sync data
parallelism, and every context routing its own rows.

    exchange.py          ExpertGroup: the all-to-all that sends each expert's slots to its context, and back
    expert_parallel.py   ExpertParallel: groups of N contexts, the experts' shards, their gradients' sums
"""
