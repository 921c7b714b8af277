"""Who is calling and what they may use: the `Principal` and its plan (identity), API keys
from a file (apikeys), JWTs checked against a JWKS file (jwks), the two combined
(credentials), both files reloaded when they rotate (reload), and the prefix cache's
salt for a caller's tenant (cachesalt).
"""
