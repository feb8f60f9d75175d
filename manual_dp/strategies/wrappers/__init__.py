"""Around any strategy (each a base.Wrapper), applied from outside after the layout is built.

    accum.py        GradAccum: N batches' gradients added up, then one update
    loss_scaled.py  LossScaled: fp16's dynamic loss scale
    compressed.py   Compressed: --compress's error feedback around data parallelism
    digested.py     Digested: --digests, every tensor's digest after each update
    straggler.py    Straggler: --straggler, one context's gradients late by its compute x (FACTOR - 1)
    ledgered.py     Ledgered: --ledger, an MoE GPT's routing of every token after each update
"""
