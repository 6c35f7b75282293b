"""Structured extraction: free text in, pydantic objects out.

A pydantic model is the `json_schema` of a `gen`, so the sampler is masked to
JSON that matches the model's schema, token by token: even SmolLM2-135M cannot
produce a malformed record. A batch of texts runs with `run_batch` (the shared
instructions are prefilled once), and every output is checked with pydantic's
`model_validate_json`. Run: `python examples/agents/json_extraction.py`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

import arborlm as sgl


class Contact(BaseModel):
    """One person mentioned in a text. Bounded strings keep a weak model's output finite."""

    name: str = Field(min_length=1, max_length=32)
    company: str = Field(min_length=1, max_length=32)
    role: Literal["engineer", "manager", "designer", "sales", "other"]
    years_experience: int = Field(ge=0, le=60)


TEXTS = [
    "Maria Lopez has been a backend engineer at Nimbus Labs for seven years.",
    "Our new sales lead, Tom Becker, joined Orbital Foods with 12 years in retail.",
    "Priya Nair manages the platform team at Quantix and has 15 years of experience.",
    "Jonas Berg, a product designer at Fjord Studio, started his career 4 years ago.",
    "Chen Wei is an engineer at Harbor Robotics; she graduated two years ago.",
    "Amelia Hart is the operations manager of Green Valley Farms, with 20 years behind her.",
]

INSTRUCTIONS = (
    "You extract contact records from short texts. For every text, answer with one JSON "
    "object with the person's name, the company they work for, their role (engineer, "
    "manager, designer, sales or other) and their years of experience as a whole number."
)


@sgl.function
def extract(s, text):
    s += sgl.system(INSTRUCTIONS)
    s += sgl.user(f"Text: {text}")
    s += sgl.assistant(sgl.gen("record", json_schema=Contact, max_tokens=80))


@dataclass
class Extraction:
    text: str
    raw: str
    contact: Contact | None
    error: str | None
    finish_reason: dict


def main(backend=None, *, model: str | None = None, texts: list[str] | None = None) -> list[Extraction]:
    """Extract one `Contact` per text; print and return them (with the raw JSON and any error).

    `backend`: an `arborlm.Engine` or DSL backend; None starts an Engine on `model`.
    """
    if backend is None:
        start = time.perf_counter()
        with sgl.Engine(model=model) as engine:
            print(f"engine ready in {time.perf_counter() - start:.1f} s")
            return main(engine, texts=texts)
    texts = TEXTS if texts is None else texts
    start = time.perf_counter()
    # Greedy, and no repetition penalty: extraction copies words from the prompt, which a
    # penalty would push away from; the schema's bounds already keep the output finite.
    states = extract.run_batch([{"text": t} for t in texts], backend=backend, temperature=0)
    results = []
    for text, state in zip(texts, states):
        if state.error() is not None:
            results.append(Extraction(text, "", None, repr(state.error()), {}))
            continue
        raw, meta = state["record"], state.get_meta_info("record")
        try:
            contact, error = Contact.model_validate_json(raw), None
        except ValidationError as e:  # only a record cut by max_tokens can get here
            contact, error = None, str(e)
        results.append(Extraction(text, raw, contact, error, meta["finish_reason"]))
    for r in results:
        print(f"- {r.text}\n  -> {r.contact!r}" if r.contact else f"- {r.text}\n  !! {r.error}")
    valid = sum(r.contact is not None for r in results)
    print(f"\n{valid} of {len(results)} records validated with pydantic "
          f"in {time.perf_counter() - start:.1f} s")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    main(model=parser.parse_args().model)
