"""Words the diagnoses of several labs share."""

NO_SQRT_D = "the scores are not divided by √D: scale q·k by 1/sqrt(D) before the softmax"
BY_D = "the scores are divided by D, not by √D"
GQA_MODULO = ("query head h read K/V head h % H_KV: the groups are consecutive heads, so it is "
              "K/V head h // (H // H_KV)")
