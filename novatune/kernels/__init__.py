"""Raw Triton kernels, one file per op (<op>_fwd, <op>_bwd); their fp32 oracles live in novatune.reference.

Nothing here imports torch.autograd or transformers: kernels take tensors and return tensors.
"""
