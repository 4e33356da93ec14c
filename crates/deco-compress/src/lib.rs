//! Compression of Llama-family models: pruning (unstructured, N:M, structured) and distillation.
