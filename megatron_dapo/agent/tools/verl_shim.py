"""verl's tool interface, for running verl tool classes where verl is not installed.

A verl tool module starts with ``from verl.tools.base_tool import BaseTool`` and ``from
verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse`` (and often ``from
verl.utils.rollout_trace import rollout_trace_op``). :func:`install` puts modules of those names
into ``sys.modules`` when ``import verl`` fails, so such a module imports and its class runs in
a tool worker. Written from verl's interface (BaseTool's constructor and async methods, the
schema models' fields), not from its code; nothing else of verl is provided, so a tool that
needs more of verl (``verl.utils.reward_score``...) needs verl itself.

The schema models are pydantic models, as in verl (pydantic comes with wandb, a dependency).
"""

# no `from __future__ import annotations`: pydantic reads these annotations as objects, and the
# models are built inside a function, where string annotations could not be resolved later
import json
import sys
import types
from typing import Any, Literal
from uuid import uuid4

__all__ = ["SCHEMA_NAMES", "build", "install", "rollout_trace_op"]

# verl.tools.schemas' public names, all provided
SCHEMA_NAMES = (
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
)


def rollout_trace_op(func):
    """verl's tracing decorator; tracing is verl's, so here it changes nothing."""
    return func


def build() -> dict[str, Any]:
    """The interface's classes by verl's names (``BaseTool`` and :data:`SCHEMA_NAMES`).

    Built on demand: pydantic takes 0.2 s to import, and a worker without verl tools never needs it."""
    from pydantic import BaseModel, ConfigDict, Field, model_validator

    class _Model(BaseModel):
        # schemas in the wild carry keys verl's models do not name (items, minimum...): keep them
        model_config = ConfigDict(extra="allow")

    class OpenAIFunctionPropertySchema(_Model):
        type: str | None = None
        description: str | None = None
        enum: list[Any] | None = None

    class OpenAIFunctionParametersSchema(_Model):
        type: str = "object"
        properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
        required: list[str] = Field(default_factory=list)

    class OpenAIFunctionSchema(_Model):
        name: str
        description: str = ""
        parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
        strict: bool = False

    class OpenAIFunctionToolSchema(_Model):
        type: str = "function"
        function: OpenAIFunctionSchema

    class OpenAIFunctionParsedSchema(_Model):
        name: str
        arguments: str  # the arguments as a JSON string, as a model wrote them

    class OpenAIFunctionCallSchema(_Model):
        name: str
        arguments: dict[str, Any] = Field(default_factory=dict)

        @staticmethod
        def from_openai_function_parsed_schema(parsed_schema):
            """``(call, has_decode_error)``: arguments that are not a JSON object become ``{}``."""
            try:
                arguments = json.loads(parsed_schema.arguments)
            except ValueError:
                arguments = None
            ok = isinstance(arguments, dict)
            return OpenAIFunctionCallSchema(
                name=parsed_schema.name, arguments=arguments if ok else {}
            ), not ok

    class OpenAIFunctionToolCall(_Model):
        id: str
        type: Literal["function"] = "function"
        function: OpenAIFunctionCallSchema

    class ToolResponse(BaseModel):
        """A tool's answer: text, and images or videos (lists) for multimodal models."""

        text: str | None = None
        image: list[Any] | None = None
        video: list[Any] | None = None

        @model_validator(mode="before")
        @classmethod
        def _media_are_lists(cls, values: Any) -> Any:
            if isinstance(values, dict):
                for key in ("image", "video"):
                    if values.get(key) is not None and not isinstance(values[key], list):
                        raise ValueError(f"ToolResponse.{key} must be a list (wrap one item as [item])")
            return values

        def is_empty(self) -> bool:
            return not self.text and not self.image and not self.video

        def is_text_only(self) -> bool:
            return bool(self.text) and not self.image and not self.video

    class BaseTool:
        """verl's tool base class: one object per tool, one instance id per trajectory.

        ``create`` starts an instance (returns ``(instance_id, ToolResponse)``), ``execute`` runs
        a call (returns ``(ToolResponse, step_reward, metrics)``), ``release`` ends the instance.
        """

        def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
            self.config = config
            self.tool_schema = tool_schema
            if self.tool_schema is None:
                self.tool_schema = self.get_openai_tool_schema()
            if self.tool_schema is None:
                raise ValueError(
                    f"{type(self).__name__}: no tool schema given and get_openai_tool_schema returned None"
                )
            self.name = self.tool_schema.function.name

        def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
            return getattr(self, "tool_schema", None)

        async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
            return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

        async def execute(
            self, instance_id: str, parameters: dict[str, Any], **kwargs
        ) -> tuple[ToolResponse, float, dict]:
            raise NotImplementedError(
                f"{type(self).__name__} does not implement execute(instance_id, parameters)"
            )

        async def calc_reward(self, instance_id: str, **kwargs) -> float:
            return 0.0

        async def release(self, instance_id: str, **kwargs) -> None:
            return None

    found = dict(locals())
    return {name: found[name] for name in ("BaseTool", *SCHEMA_NAMES)}


def install() -> bool:
    """Put modules under verl's names (``verl.tools.base_tool``, ``verl.tools.schemas``,
    ``verl.utils.rollout_trace``) in ``sys.modules`` unless verl itself imports.

    True when it installed them; False when the real verl is there or the shim already is."""
    if "verl" in sys.modules:
        return False
    try:
        import verl  # noqa: F401
    except ImportError:
        pass
    else:
        return False
    classes = build()
    schemas = {name: classes[name] for name in SCHEMA_NAMES}

    def module(name: str, package: bool, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(name, f"megatron_dapo's stand-in for {name} (verl is not installed)")
        if package:
            mod.__path__ = []  # a package without files: `import verl.tools.gsm8k_tool` fails cleanly
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
        return mod

    module("verl", True, __megatron_dapo_shim__=True)
    module("verl.tools", True)
    module("verl.utils", True)
    module("verl.tools.schemas", False, **schemas)
    module(
        "verl.tools.base_tool",
        False,
        BaseTool=classes["BaseTool"],
        **schemas,
        rollout_trace_op=rollout_trace_op,
    )
    module("verl.utils.rollout_trace", False, rollout_trace_op=rollout_trace_op)
    return True
