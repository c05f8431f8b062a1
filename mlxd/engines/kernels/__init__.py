"""CPU kernels: the prefill path, few-row sgemv, depthwise convolutions, the chunked delta
rule and base-2 activations. They know no engine."""
