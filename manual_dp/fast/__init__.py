"""The same step, faster: what the lesson's code becomes when it has to run at speed.

    collectives  all-reduce algorithms with the lesson's contract, and their registry
    flat         one flat buffer per device for parameters, gradients and optimiser state
    graph        LeNet traced once into a cached symbolic graph
    prefetch     batches prepared ahead in a thread, handed to MXNet without waiting
    runtime      thread and engine settings, chosen before MXNet loads
"""
