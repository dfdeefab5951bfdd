"""How request ids are derived from one another: the one scheme, so that no two live requests share an id.

An id is derived by appending a marker and an index to its parent; each kind of derivation has its own marker, so
ids of different kinds never collide, whatever ids callers choose:
- `prompt_id(request, i)`: prompt `i` of a served request that carries several prompts (`<request>-<i>`); the
  serving core submits each prompt to the engine under this id.
- `call_id(caller, serial)`: one `AsyncLLMEngine.generate` call (`<caller>@<serial>`, `serial` unique in the
  engine's life): a caller's id may be reused once its request ended, the engine's id never is.
- `sample_id(request, i)`: sample `i` of a request with `n > 1` (`<request>#<i>`); a request with one sample keeps
  its own id.
"""


def prompt_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def call_id(caller_id: str, serial: int) -> str:
    return f"{caller_id}@{serial}"


def sample_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"
