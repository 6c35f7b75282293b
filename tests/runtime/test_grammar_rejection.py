"""How the front turns a grammar the scheduler refused into an error (tokenizer_manager)."""

import pytest

from arborlm.errors import InvalidRequestError, ServerOverloadedError
from arborlm.runtime.io_struct import ReqOutput
from arborlm.runtime.tokenizer_manager import _raise_if_rejected


def refused(code):
    reason = {"type": "abort", "message": "refused", "param": "json_schema", "code": code}
    return ReqOutput(rid="r", new_token_ids=[], finish_reason=reason, prompt_tokens=1, completion_tokens=0,
                     cached_tokens=0)


def test_a_grammar_that_failed_to_compile_is_a_bad_request():
    with pytest.raises(InvalidRequestError) as info:
        _raise_if_rejected(refused(None))
    assert info.value.param == "json_schema"


def test_overloaded_compiles_are_a_503_to_retry():
    """Issue 16: while too many abandoned compiles still run, a new slow compile is refused with
    503 (ServerOverloadedError), not 400: the request was fine, the server is busy."""
    with pytest.raises(ServerOverloadedError):
        _raise_if_rejected(refused("server_overloaded"))
