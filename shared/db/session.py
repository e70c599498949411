"""Engine, sessions and migrations."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def make_engine(url: str, **kw: Any) -> AsyncEngine:
    if not url.startswith("postgresql+asyncpg://"):
        raise ValueError(f"database_url must be a postgresql+asyncpg:// URL, got {url.split('://')[0]}://...")
    kw.setdefault("pool_pre_ping", True)  # survive a database restart without a service restart
    kw.setdefault("pool_size", 5)
    return create_async_engine(url, **kw)


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def _alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


async def upgrade(url: str, revision: str = "head") -> None:
    """Alembic upgrade (runs in a thread: Alembic's env drives its own event loop)."""
    from alembic import command

    await asyncio.to_thread(command.upgrade, _alembic_config(url), revision)


async def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    await asyncio.to_thread(command.downgrade, _alembic_config(url), revision)


async def ping(engine: AsyncEngine, timeout: float = 2.0) -> bool:
    async def _q() -> None:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    try:
        await asyncio.wait_for(_q(), timeout)
        return True
    except Exception:
        return False


def upsert(model, values: dict[str, Any] | list[dict[str, Any]], *, update: list[str] | None = None):
    """INSERT ... ON CONFLICT (primary key) DO NOTHING, or DO UPDATE of the ``update`` columns."""
    stmt = pg_insert(model).values(values)
    keys = [c.name for c in model.__table__.primary_key.columns]
    if update:
        return stmt.on_conflict_do_update(index_elements=keys, set_={c: stmt.excluded[c] for c in update})
    return stmt.on_conflict_do_nothing(index_elements=keys)
