"""One router per resource; app/main.py includes them."""
