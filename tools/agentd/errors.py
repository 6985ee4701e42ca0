"""Errors llmgw-agentd raises on purpose; each becomes a shard's or an install's reason."""

from llmgw import errors
from llmgw.errors import Error


class AgentError(Error):
    """Something the agent was asked to do cannot be done."""


class WeightsError(AgentError):
    """A model's weights cannot be fetched, or are not the file that was asked for."""


class EngineError(AgentError, errors.EngineError):
    """An engine cannot be installed, or its command cannot be built."""


class EngineUnfit(EngineError):
    """An engine this node cannot run at all (it needs a GPU and the node has none): no
    retry of its install would change that."""
