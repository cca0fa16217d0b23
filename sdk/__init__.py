"""foretell.sdk: the Python client for the foretell proxy and any OpenAI-compatible server.

Imports without torch (httpx and tiktoken only). See docs/sdk.md.

    from foretell.sdk import Client, edit

    with Client() as client:  # FORETELL_BASE_URL, else OPENAI_BASE_URL, else 127.0.0.1:8000
        result = edit(client, open("app.py").read(), "Rename foo to bar", model="gemma-3-270m",
                      filename="app.py")
        print(result.diff, result.accepted_prediction_tokens, result.tokens_per_second)
"""

from foretell.sdk._config import DEFAULT_BASE_URL
from foretell.sdk._logs import setup_logging
from foretell.sdk._transport import RetryPolicy
from foretell.sdk.client import AsyncClient, Client
from foretell.sdk.edit import (
    AsyncEditStream,
    EditProgress,
    EditResult,
    EditStream,
    aedit,
    aedit_stream,
    build_edit_prompt,
    edit,
    edit_stream,
    unified_diff,
)
from foretell.sdk.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    EditTruncatedError,
    ForetellError,
    ForetellWarning,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    TokenizerUnavailableError,
    UnprocessableEntityError,
)
from foretell.sdk.estimates import (
    PredictionEstimate,
    count_tokens,
    estimate_prediction,
    prediction_issues,
)
from foretell.sdk.prediction import normalize_prediction, prediction_from_file
from foretell.sdk.raw_response import RawResponse
from foretell.sdk.streaming import AsyncStream, Stream
from foretell.sdk.types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelList,
    SpeculationReport,
    Usage,
)

__all__ = [
    "DEFAULT_BASE_URL", "RetryPolicy", "Client", "AsyncClient",
    "edit", "aedit", "edit_stream", "aedit_stream", "EditResult", "EditProgress", "EditStream",
    "AsyncEditStream", "build_edit_prompt", "unified_diff",
    "ForetellError", "ForetellWarning", "APIConnectionError", "APITimeoutError", "APIStatusError",
    "BadRequestError", "AuthenticationError", "PermissionDeniedError", "NotFoundError",
    "ConflictError", "RequestTooLargeError", "UnprocessableEntityError", "RateLimitError",
    "InternalServerError", "TokenizerUnavailableError", "EditTruncatedError",
    "count_tokens", "estimate_prediction", "prediction_issues", "PredictionEstimate",
    "normalize_prediction", "prediction_from_file",
    "Stream", "AsyncStream", "RawResponse", "ChatCompletion", "ChatCompletionChunk", "Completion",
    "ModelList", "SpeculationReport", "Usage",
]

# FORETELL_LOG=info|debug: log retries (and, at debug, every request) to stderr.
setup_logging()
