"""Tool calls on the local model's chats.

A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` become a ``ToolPlan``
(``format.py``: None when no tools are offered). The prompt shows the tools and the round trip's
history (``prompt.py``): through the chat template where it renders tools, else in foretell's
plain format. ``tool_choice`` "required" or a named function decodes under a grammar of the
functions' parameter schemas (``format.call_grammar``; exact under speculation, as structured
output is); "auto" decodes freely. Either way the answer is read into content and calls as it
streams (``parser.py``), the same reading for the stream and the body.
"""
