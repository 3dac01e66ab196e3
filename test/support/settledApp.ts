// An application process for the settlement tests: it subscribes two transactional handlers ("mark-paid"
// and "send-receipt") that each insert one row per event into its own table, `applied`, which has no
// unique constraint. Run as `node test/support/settledApp.ts`, so that a test can kill -9 it mid-handler.
// DATABASE_URL: the test's database; SETTLED_MODE=at-least-once: the same handlers, non-transactional.
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { Outboxd, type SettlementTransaction } from '../../src/index.ts';

export const SUBSCRIBERS = ['mark-paid', 'send-receipt'] as const;
export const CREATE_APPLIED = `create table if not exists applied (subscriber text not null, operation_id uuid not null, pid int not null)`;

if (process.argv[1] === fileURLToPath(import.meta.url)) await main();

async function main(): Promise<void> {
  const url = process.env.DATABASE_URL!;
  const transactional = process.env.SETTLED_MODE !== 'at-least-once';
  const pool = new pg.Pool({ connectionString: url, max: 4 });
  const outboxd = new Outboxd({ connectionString: url, onError: () => {} });
  for (const subscriber of SUBSCRIBERS) {
    const apply = async (operationId: string, db: SettlementTransaction) => {
      await db.query('insert into applied (subscriber, operation_id, pid) values ($1, $2, $3)', [subscriber, operationId, process.pid]);
      // A handler that takes a moment after its write, so that a kill lands inside deliveries.
      await db.query('select pg_sleep($1)', [0.1 + Math.random() * 0.2]);
    };
    if (transactional) await outboxd.onSettled((event, tx) => apply(event.operationId, tx), { transactional: true, subscriber });
    else await outboxd.onSettled((event) => apply(event.operationId, pool as unknown as SettlementTransaction), { subscriber });
  }
  console.log('subscribed');
}
