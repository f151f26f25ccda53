"""A drafter with another tokenizer, bridged to the target's vocabulary (Timor et al., ICML 2025).

- :mod:`~dsi.models.vocab.vocabulary`: what each token spells (:class:`Vocabulary`), the tokens two
  vocabularies spell alike (:class:`Intersection`);
- :mod:`~dsi.models.vocab.merges`: the intersection's law extended to target tokens the drafter spells
  in two (:class:`MergeTable`);
- :mod:`~dsi.models.vocab.bridge`: :class:`CrossVocabularyDrafter`, any drafter seen as a drafter over the
  target's ids (string-level for greedy decoding, token intersection for sampling), and
  :func:`bridge_drafter`, which wraps a drafter only when the vocabularies differ.

It works over any :class:`~dsi.models.base.LanguageModel` and its tokenizer, so it imports no backend.
"""

from dsi.models.vocab.bridge import VOCAB_MODES, CrossVocabularyDrafter, bridge_drafter, shares_vocabulary
from dsi.models.vocab.merges import MergeTable
from dsi.models.vocab.vocabulary import Intersection, Vocabulary

__all__ = ["VOCAB_MODES", "CrossVocabularyDrafter", "Intersection", "MergeTable", "Vocabulary", "bridge_drafter",
           "shares_vocabulary"]
