"""Evaluation: speculative decoding of trained or published drafters against their target (speculative.py),
the single-drafter report (evaluate.py), the public benchmarks (benchmarks.py), drafters side by side
(side_by_side.py), a serving engine's own figures (server.py) and the dflash-eval command (cli.py)."""
