"""CPU kernels: the prefill path, attention over quantized KV, few-row sgemv, depthwise
convolutions, the chunked delta rule and base-2 activations. They know no engine."""
