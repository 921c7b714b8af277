"""(in progress)"""

from fastapi import APIRouter

router = APIRouter()
