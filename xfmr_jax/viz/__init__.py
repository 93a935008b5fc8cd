"""Pictures of the model, shared by the notebooks and ``experiments/figures.py``.

Each plotting function draws on a matplotlib ``Axes`` (created if not given)
and returns it (or the array of axes it drew on), so a notebook can compose
figures and a script can :func:`save` them. The functions of
:mod:`~xfmr_jax.viz.measurements` (and ``mask_gallery``) compute what they
draw with the library's own functions: the picture is then a measurement of
this code, not an illustration.

  training     read_metrics, training_curve                      (plots)
  attention    attention_map, attention_heads, token_alignment,
               translation_attention                             (plots)
  anatomy      mask_image, mask_gallery, positional_heatmap,
               position_similarity                               (plots)
               score_histograms, permutation_errors, equivariance_plot,
               attention_cost, complexity_plot                   (measurements)
  overview     architecture_diagram                              (diagram)
"""
from xfmr_jax.viz.diagram import architecture_diagram
from xfmr_jax.viz.figure import save
from xfmr_jax.viz.measurements import (attention_cost, complexity_plot,
                                       equivariance_plot, permutation_errors,
                                       score_histograms)
from xfmr_jax.viz.plots import (EXAMPLE_SENTENCE, attention_heads, attention_map, mask_gallery,
                                mask_image, position_similarity,
                                positional_heatmap, read_metrics,
                                token_alignment, training_curve,
                                translation_attention)

__all__ = ['EXAMPLE_SENTENCE', 'architecture_diagram', 'attention_cost', 'attention_heads',
           'attention_map', 'complexity_plot', 'equivariance_plot',
           'mask_gallery', 'mask_image', 'permutation_errors',
           'position_similarity', 'positional_heatmap', 'read_metrics', 'save',
           'score_histograms', 'token_alignment', 'training_curve',
           'translation_attention']
