"""Raw Triton kernels and their fp32 references, one file per op (<op>_fwd, <op>_bwd, <op>_ref).

Nothing here imports torch.autograd or transformers: kernels take tensors and return tensors.
"""
