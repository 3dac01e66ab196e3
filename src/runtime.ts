// Opens what a command needs from the Config: the database (DATABASE_URL or the embedded default,
// migrated on the fly since a developer's first run has no schema yet) and a pool.
import type { Config } from './config.ts';
import { startEmbeddedPostgres } from './db/embedded.ts';
import { migrate } from './db/migrate.ts';
import { createPool, type Pool } from './db/pool.ts';
import type { Logger } from './log.ts';

export interface Database {
  url: string;
  embedded: boolean;
  /** Stops the embedded cluster if this process started it. */
  close(): Promise<void>;
}

export async function openDatabase(config: Config, log: Logger): Promise<Database> {
  if (config.databaseUrl) return { url: config.databaseUrl, embedded: false, close: async () => {} };
  const cluster = await startEmbeddedPostgres({ dataDir: config.dataDir, log });
  await migrate(cluster.url);
  return { url: cluster.url, embedded: true, close: () => cluster.stop() };
}

export function openPool(db: Database, name: string, max = 10): Pool {
  return createPool(db.url, { max, applicationName: name });
}
