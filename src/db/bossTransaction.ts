// A transaction pg-boss can open and settle from another call frame (its `beginTransaction`), on an
// application's own pool, so that a transactional onSettled works on `new Outboxd({ pool })` as it does
// on pg-boss's built-in pool, with the same guarantees as that one's (pg-boss's dist/db.js).
import type pg from 'pg';
import type { Db } from 'pg-boss';
import { withinDeadline } from '../types/deadline.ts';
import { bossQuery } from './pool.ts';

type TransactionHandle = Awaited<ReturnType<NonNullable<Db['beginTransaction']>>>;

/** How long a ROLLBACK may wait behind a statement still in flight before the connection is dropped. */
const ROLLBACK_TIMEOUT_MS = 5_000;

export async function beginBossTransaction(pool: pg.Pool): Promise<TransactionHandle> {
  const client = await pool.connect();
  let released = false;
  let lost: Error | undefined;
  const release = (err?: Error) => {
    if (released) return;
    released = true;
    client.removeListener('error', onError);
    client.release(err);
  };
  // A connection that dies while checked out emits 'error' with no listener of the pool's: the
  // transaction is lost, the client is discarded.
  const onError = (err: Error) => {
    lost ??= err;
    release(err);
  };
  client.on('error', onError);
  try {
    await client.query('begin');
  } catch (err) {
    release(err as Error);
    throw err;
  }
  const settled = () => lost ?? new Error('the transaction is already settled');
  return {
    db: {
      // A statement issued late by a handler abandoned at its timeout must not land on a client the pool
      // has handed to someone else.
      executeSql: (text: string, values?: unknown[]) => (released ? Promise.reject(settled()) : bossQuery(client, text, values)),
    },
    async commit() {
      if (released) throw settled();
      try {
        await client.query('commit');
      } catch (err) {
        release(err as Error);
        throw err;
      }
      release();
    },
    async rollback() {
      if (released) return;
      try {
        await withinDeadline(client.query('rollback'), ROLLBACK_TIMEOUT_MS, () => new Error('ROLLBACK did not complete in time'));
        release();
      } catch (err) {
        release(err as Error);
      }
    },
  };
}
