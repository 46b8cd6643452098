"""Chat data for supervised fine-tuning: conversation records -> token ids and a loss mask, by the model's template.

Input: one record (``messages`` or ``prompt``/``completion``) and a local model dir. Output: ``MaskedConversation``
(token ids, 1 where a token carries loss) or a ``Rejection`` with its reason, for ``rejects``. Pure functions, no I/O
beyond loading the template; the stages that read manifests and write shards are wired around them.
``records`` parses and validates, ``template`` loads and checks the template, ``masks`` renders and masks,
``pack`` places masked conversations whole into rows of ``seq_len`` with their loss mask (``core.shards.chat``).
"""
