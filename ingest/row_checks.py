"""Every check of a row, in one module, each run once.

Whether a model is served: `model_name_problem` (a job's model on the service: a registered name, never a path),
`choose_model` (the model `tokenmill run` takes from an OpenAI file's rows, or why none of them is served),
`unserved_model` (a line the OpenAI Batch API refuses at creation) and `model_not_found` (a row a job's shard
fails). A shard's rows are checked by `RowChecks.check_rows` on the shard's own thread, before the engine thread
sees them: the model, the endpoint against the engine's kind, the sampling (or pooling) parameters, a structured
output's grammar and the LoRA adapter, which is loaded here. A row comes out as a `CheckedRow` (its parameters
and adapter, for the engine loop to tokenize and add) or as its `RowError`."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ingest.sampling import ALLOW_BEAM_SEARCH, ResponseFormatError, check_for_model, kept_beams, sampling_params
from storage.formats import EMBEDDINGS, Request, RowError

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# ---- the models a job serves ---------------------------------------------------------------------------

def model_name_problem(field_name: str, name: Any) -> str | None:
    """Why `name` is not a model registered here (`tokenmill model list`), a name and never a path; None when it
    is one."""
    from engine.model_loader import list_models

    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
        return f"{field_name}: {name!r} is not a model name (letters, digits, '.', '_', '-'; no paths)"
    registered = [row["name"] for row in list_models()]
    if name not in registered:
        return f"{field_name}: unknown model {name!r}; registered: {', '.join(registered)} (tokenmill model list)"
    return None


def choose_model(named: Mapping[Any, tuple[int, int]], model: str, model_given: bool, aliases: Collection[str],
                 bundled: Collection[str], input_name: str) -> tuple[str, str | None]:
    """The model `tokenmill run` serves an OpenAI file with, from the models its rows name (`named`: model ->
    (rows, first line); None: rows naming none): rows that all name one bundled model run it when no model was
    given. Second, why the run is refused when every row names a model it does not serve (None: it is not; rows
    of a mixed file that name another model fail alone, `model_not_found`)."""
    wanted = {name for name in named if name is not None}
    if not model_given and None not in named and len(wanted) == 1:
        [only] = wanted
        if only in bundled and only not in aliases:
            model = only
    served = {model, *aliases}
    if wanted and None not in named and not wanted & served:
        listing = ", ".join(f"{name!r} ({count} rows, first on line {line})"
                            for name, (count, line) in sorted(named.items()))
        return model, (f"every row of {input_name} names a model this run does not serve: {listing}; it serves "
                       f"{', '.join(map(repr, sorted(served)))}. Give --model (bundled: {', '.join(bundled)}), or "
                       f"--served-model-name for another name of it")
    return model, None


def _serves(model: Any, served: Collection[str], adapters: Collection[str] = ()) -> bool:
    """Does a row naming `model` run here? Always when `served` is empty (any goes) or the row names none."""
    return not served or model is None or (isinstance(model, str) and (model in served or model in adapters))


def unserved_model(model: Any, served: Collection[str]) -> str | None:
    """The OpenAI Batch API's refusal of a line naming a model it does not serve (None: served)."""
    if _serves(model, served):
        return None
    return f"model {model!r} is not served here (served: {', '.join(repr(name) for name in sorted(served))})"


def model_not_found(request: Request, models: Collection[str], adapters: Collection[str] = ()) -> RowError | None:
    """The `model_not_found` error of a row naming neither one of `models` (none: any goes) nor an adapter."""
    if _serves(request.model, models, adapters):
        return None
    served = ", ".join(map(repr, sorted(models)))
    if adapters:
        served += f" and the LoRA adapters {', '.join(map(repr, sorted(adapters)))}"
    return RowError(request.row, request.custom_id, "model_not_found",
                    f"The model {request.model!r} does not exist here; this job serves {served}")


# ---- a shard's rows ------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class CheckedRow:
    """A row that passed every check: the parameters it runs with (`SamplingParams`, `BeamSearchParams`, or an
    embedding row's `PoolingParams`), its LoRA adapter loaded (None: the base model), and for a beam search how
    many of its beams are its choices."""

    request: Request
    params: Any
    adapter: Any = None  # engine.lora.adapter.LoRAAdapter
    beams: int | None = None

    @property
    def row(self) -> int:
        return self.request.row

    @property
    def custom_id(self) -> str:
        return self.request.custom_id


@dataclass
class RowChecks:
    """How a job's rows are checked: its sampling defaults, the model names its rows may give (none: any), the
    LoRA adapters they may name (`adapter_names`) and those resolved for this shard (`adapters`: name ->
    `LoRARequest`, or why it cannot be served), and whether an embedding row's over-long inputs are cut."""

    defaults: dict[str, Any]
    models: frozenset[str] = frozenset()
    adapters: Mapping[str, Any] = field(default_factory=dict)
    adapter_names: frozenset[str] = frozenset()
    truncate_inputs: bool = False
    _adapters_loaded: dict[str, Any] = field(default_factory=dict, repr=False)  # adapter name -> adapter, or why not

    def check_rows(self, engine: Any, rows: list[Request | RowError]) -> list[CheckedRow | RowError]:
        """Each row checked against `engine` (the one it will run on); a row that failed earlier stays as it is."""
        return [row if isinstance(row, RowError) else self._check_alone(engine, row) for row in rows]

    def _check_alone(self, engine: Any, request: Request) -> CheckedRow | RowError:
        try:
            return self.check(engine, request)
        except Exception as error:  # a check that raises fails its row alone, as the engine's add would
            return RowError(request.row, request.custom_id, "engine_error",
                            f"the engine raised {type(error).__name__} while running this request")

    def check(self, engine: Any, request: Request) -> CheckedRow | RowError:
        """The row with its parameters and adapter, or its error: `model_not_found`, `invalid_request` (a text row
        on an embedding model or the other way round), `unsupported_parameter`, `invalid_parameter`,
        `invalid_response_format`, `invalid_adapter`."""
        def error(code: str, message: str) -> RowError:
            return RowError(request.row, request.custom_id, code, message)

        embeds = getattr(engine, "embedding_size", None) is not None
        if unknown := model_not_found(request, self.models, () if embeds else self._adapter_names):
            return unknown
        if embeds != (request.endpoint == EMBEDDINGS):
            return error("invalid_request", f"{request.endpoint} needs a model that generates text; "
                                            f"{engine.config.model!r} embeds (use /v1/embeddings)"
                         if embeds else
                         f"model {engine.config.model!r} generates text and has no embeddings: /v1/embeddings "
                         f"needs an embedding model (e.g. all-minilm-l6-v2)")
        if embeds:
            return self._check_pooling(engine, request, error)
        if request.openai and "beam_width" in request.params and not self.defaults.get(ALLOW_BEAM_SEARCH):
            return error("unsupported_parameter", "beam_width is not an OpenAI Batch field: the job must allow beam "
                                                  "search (tokenmill run/submit --allow-beam-search)")
        try:
            params = sampling_params(self.defaults, request.params)
            if getattr(params, "beam_width", None) is None:
                check_for_model(params, engine.runner.vocab_size)
        except ResponseFormatError as problem:
            return error("invalid_response_format", str(problem))
        except (ValueError, TypeError) as problem:
            return error("invalid_parameter", str(problem))
        if getattr(params, "structured_outputs", None) is not None:
            try:
                engine.structured.compile(params.structured_outputs)  # cached per schema, for the engine's add
            except ValueError as problem:
                return error("invalid_response_format", str(problem))
        adapter = self._adapter(engine, request.model)
        if isinstance(adapter, str):
            return error("invalid_adapter", adapter)
        return CheckedRow(request, params, adapter, kept_beams(params, request.params, self.defaults))

    @property
    def _adapter_names(self) -> Collection[str]:
        return self.adapter_names or self.adapters.keys()

    def _check_pooling(self, engine: Any, request: Request, error) -> CheckedRow | RowError:
        from engine.pooling import PoolingParams

        try:
            params = PoolingParams(dimensions=request.params.get("dimensions"), truncate=self.truncate_inputs)
            engine.check_params(params)
        except ValueError as problem:
            return error("invalid_parameter", str(problem))
        return CheckedRow(request, params)

    def _adapter(self, engine: Any, model: Any) -> Any:
        """The row's LoRA adapter, loaded once per shard and name (None: the base model), or why it cannot be
        served: not resolved (a fetch that failed), or refused by the engine (rank, target modules, files)."""
        if not isinstance(model, str) or model not in self.adapters:
            return None
        if model not in self._adapters_loaded:
            request = self.adapters[model]
            try:
                self._adapters_loaded[model] = request if isinstance(request, str) else engine.load_adapter(request)
            except ValueError as problem:
                self._adapters_loaded[model] = str(problem)
        return self._adapters_loaded[model]
