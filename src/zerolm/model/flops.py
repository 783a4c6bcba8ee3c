"""The model's FLOPs per token, as MFU counts them (zerolm.observe.mfu says the convention):

    6·N + 12·L·d·T

N the parameters a matmul reads (zerolm.model.decoder.count_params(matmul_only): no position table, no untied
token embedding's lookup), L layers, d the model width, T the sequence length. 6·N is every weight matmul's
forward (2) and backward (4) FLOPs; 12·L·d·T the attention's QKᵀ and A·V over the whole T × T scores,
forward and backward (a causal kernel computes about half of that).
"""


def flops_per_token(n_params_no_pos: int, n_layer: int, d_model: int, seq_len: int) -> float:
    return 6 * n_params_no_pos + 12 * n_layer * d_model * seq_len
