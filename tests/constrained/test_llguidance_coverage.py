"""JSONSchemaBench coverage on llguidance, all 420 schemas, compile only (about 25 s here).

Every schema of /work/shared/data/jsonschemabench is either prepared (`LLGUIDANCE_POLICY`)
and compiled against SmolLM2's tokenizer, or refused with a GrammarError (a 400), never a
raw exception; the share compiled per sub-dataset must not drop below the recorded floor;
a schema refused for keywords llguidance does not implement must compile when the request
is lenient (what llguidance cannot build at all, such as a cycle of references through
intersections, stays refused). Validity of generated outputs
is the benchmark's (`benchmarks/bench_structured.py`) and the keyword tests' to show.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arborlm.constrained.base import GrammarError
from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.constrained.llguidance_backend import LLGuidanceBackend
from arborlm.sampling_params import SamplingParams
from tests.constrained.test_backend_agreement import VOCAB_SIZE
from tests.shared_data import jsonschemabench_dir

DATA = jsonschemabench_dir() or Path("/work/shared/data/jsonschemabench")
# Measured with llguidance 1.9.1 (compiled / total); a lower share is a regression.
FLOOR = {
    "Github_easy": 60 / 60,
    "Github_medium": 60 / 60,
    "Github_hard": 57 / 60,
    "Kubernetes": 60 / 60,
    "Snowplow": 60 / 60,
    "WashingtonPost": 47 / 60,
    "Glaiveai2K": 60 / 60,
}

pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"{DATA} is not there")


@pytest.fixture(scope="module")
def backend(tokenizer, eos) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer, VOCAB_SIZE, [eos])


def spec_of(schema, lenient: bool = False):
    return grammar_spec_from_params(SamplingParams(json_schema=schema, json_schema_lenient=lenient), "llguidance")


@pytest.mark.parametrize("subset", sorted(FLOOR))
def test_every_schema_compiles_or_is_refused(backend, subset):
    records = [json.loads(line) for line in (DATA / f"{subset}.jsonl").read_text(encoding="utf-8").splitlines()]
    compiled, refused = 0, []
    for record in records:
        try:
            backend.compile(spec_of(record["schema"]).key)
            compiled += 1
        except GrammarError as e:
            refused.append((record["id"], e.message[:100]))
            if "keywords the grammar cannot enforce" in e.message:  # lenient mode leaves keywords out: it must then compile
                backend.compile(spec_of(record["schema"], lenient=True).key)
    print(f"\n{subset}: compiled {compiled}/{len(records)}; refused: {refused}")
    assert compiled / len(records) >= FLOOR[subset] - 1e-9
