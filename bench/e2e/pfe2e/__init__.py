"""End-to-end time-to-first-token harness for a KV-cache server (bench/e2e/README.md).

Torch-free modules (tested on CPU in CI): `hashing` (vLLM's chained block hashes), `layout`
(vLLM's paged KV layout, registration facts, page <-> contiguous conversion over any array
library), `models` (model shapes), `trace` (the Mooncake trace, its scaling and the LRU
simulation), `servers` (starting and stopping servers, health, metrics, admin calls) and
`report` (results, tables, the SVG chart, the physical floor). `harness` (the model, the pages,
one prompt's cold and hit paths) and `stages` (what each stage starts and measures) need torch
and transformers; `run` is the entry point.
"""
