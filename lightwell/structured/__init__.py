"""Structured output: grammars compiled with xgrammar (cached), one matcher per constrained
sequence, the batch's token bitmask filled on the host each step. The sampler applies the mask
(``lightwell.worker.structured_output``); xgrammar is imported only once a request uses it."""
