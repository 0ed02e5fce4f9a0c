"""macer: staged MACER pruning inside a decoder's prefill (the model layer over ``macer_kernels``)."""
