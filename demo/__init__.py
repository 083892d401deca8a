"""The embedded demo: a synthetic corpus, a tiny Qwen3 target built and pretrained locally, the job that
trains drafters on it, and the evaluation glue. It uses every role (producer, consumer); no role uses it,
except the tests and benchmarks, which borrow its tiny local assets (demo.tiny)."""
