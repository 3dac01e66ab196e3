// What a write NOTIFYs on a channel: the outboxes' wake triggers (drizzle/0022_outbox_wake.sql,
// drizzle/0026_settlement_wake.sql) must send one only while someone waits for it.
import pg from 'pg';
import { waitUntil } from '../../harness/replica.ts';
import type { TestDb } from './db.ts';

/** A session LISTENing on `channel` while `use` runs: `sent(write)` is what the write sent there. */
export async function listening<T>(t: TestDb, channel: string, use: (sent: (write: () => Promise<unknown>) => Promise<string[]>) => Promise<T>): Promise<T> {
  const listener = new pg.Client({ connectionString: t.url });
  await listener.connect();
  const heard: string[] = [];
  listener.on('notification', (n) => heard.push(n.payload ?? ''));
  await listener.query(`listen "${channel}"`);
  // Notifications arrive in commit order: one sent after a write shows whether the write sent one.
  const sent = async (write: () => Promise<unknown>) => {
    const marker = `marker-${heard.length}`;
    await write();
    await t.pool.query('select pg_notify($1, $2)', [channel, marker]);
    await waitUntil(async () => heard.includes(marker), 10_000, marker);
    return heard.splice(0).filter((p) => p !== marker);
  };
  try {
    return await use(sent);
  } finally {
    await listener.end();
  }
}
