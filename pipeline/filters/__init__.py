"""Filter stage: normalisation, rule and web-grade quality filters, language id, quality classifier."""
