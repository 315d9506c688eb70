"""The e2e test's policy (tests/agent/test_glm_serve_e2e.py): the default tool-calling policy offering
file tools whose schemas a random-weight model can always satisfy under constrained decoding (paths
from an enum, bounded contents); `submit` is offered from step 10 on, so a task runs >= 10 steps."""

from openglm.agent.policy import ToolCallingPolicy

FILES = ["notes.txt", "plan.md", "data.csv"]


def _tool(name, description, properties, required):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


FILE_TOOLS = [
    _tool("create", "Create or overwrite a file.", {"path": {"type": "string", "enum": FILES},
                                                    "content": {"type": "string", "maxLength": 40},
                                                    "overwrite": {"type": "boolean", "enum": [True]}},
          ["path", "content", "overwrite"]),
    _tool("view", "Show a file.", {"path": {"type": "string", "enum": FILES}}, ["path"]),
]
SUBMIT = _tool("submit", "Finish the task.", {"summary": {"type": "string", "maxLength": 20}}, ["summary"])
FIRST_SUBMIT_STEP = 10


class FileToolsPolicy(ToolCallingPolicy):
    name = "e2e-file-tools"

    def prepare(self, ctx, state, tools):
        messages, _, events = super().prepare(ctx, state, tools)
        return messages, FILE_TOOLS + ([SUBMIT] if state.next_step >= FIRST_SUBMIT_STEP else []), events


def make(config):
    return FileToolsPolicy(context_limit=config.context_limit)
