// drizzle applies the migrations whose journal timestamp is later than the newest one a database
// recorded, and outboxd decides a database is current the same way (src/db/migrate.ts drizzlePending):
// a migration added with an earlier `when` than the one before it would be skipped everywhere, silently.
import { expect, it } from 'vitest';
import { readJournal } from '../../src/db/migrate.ts';

it('the migrations journal numbers its entries in order, each later than the one before', async () => {
  const { entries } = (await readJournal()) as { entries: { idx: number; when: number }[] };
  entries.forEach((entry, i) => {
    expect(entry.idx).toBe(i);
    if (i > 0) expect(entry.when).toBeGreaterThan(entries[i - 1]!.when);
  });
});
