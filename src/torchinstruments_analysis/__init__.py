"""Reading runs back and answering "where did training go wrong?" (imports no torch)."""
