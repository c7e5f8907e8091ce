"""The page size a CUDA worker's radix tree keys (and publishes) by: SGLang's model-runner rule, on CPU.

SGLang publishes one ``BlockStored`` per tree page, with ``block_size = len(page_tokens)``
(``mem_cache/events.py``), so the width every KV event carries is the tree's page size. The tree
gets it from the KV pool allocator the model runner builds, which needs a GPU:

* ``mem_cache/kv_cache_configurator.py`` builds the paged CUDA allocator with
  ``page_size=get_schedule().page_size * get_parallel().attn_dcp_size`` (under decode context
  parallelism the allocator spans every DCP rank's share of a page);
* ``mem_cache/kv_cache_builder.py`` gives the tree ``page_size if not get_parallel().dcp_enabled
  else token_to_kv_pool_allocator.page_size`` ("TreeCache.page_size should keep the same as
  allocator.page_size").

:func:`tree_page_size` is that rule, fed by SGLang's own ``parallel_widths_of`` on the resolved
configuration (the values ``get_parallel()`` publishes). It is pinned to :data:`SUPPORTED`;
``tests/unit/standins/test_kv_pages.py`` holds it to the installed release's source (both
expressions must be there, verbatim up to whitespace).
"""

from __future__ import annotations

from typing import Any

#: Releases whose allocator and tree-page rule are the ones stated above (read in each wheel).
SUPPORTED = ("0.5.19", "0.5.21", "0.5.23")

#: The two SGLang expressions the rule restates, whitespace removed: (file under ``sglang/srt``, text).
SOURCE_RULES = (
    ("mem_cache/kv_cache_configurator.py", "page_size=get_schedule().page_size*get_parallel().attn_dcp_size"),
    ("mem_cache/kv_cache_builder.py", "ifnotget_parallel().dcp_enabledelsetoken_to_kv_pool_allocator.page_size"),
)


def version_problem(version: str) -> str | None:
    """Why the rule is unchecked for this SGLang, or None."""
    if version in SUPPORTED:
        return None
    return (f"kvalign's tree-page rule (kvalign/standins/kv_pages.py) is pinned to SGLang {', '.join(SUPPORTED)}; "
            f"SGLang {version}'s allocator and tree page size are unchecked")


def tree_page_size(resolved: Any) -> int:
    """The tree's (and the events') page width for a resolved configuration ``resolved``.

    ``resolved`` is SGLang's resolved view of the server arguments (``resolving_view``)."""
    from sglang.srt.runtime_context import parallel_widths_of

    widths = parallel_widths_of(resolved)
    page = int(resolved.page_size)
    allocator_page = page * int(widths["attn_dcp_size"])
    return allocator_page if widths["dcp_enabled"] else page
