"""Tables: hashers, the row codec, the page layout, staging and verification."""
