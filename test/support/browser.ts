// A real browser for the console's tests: Debian's chromium (installed by npm test when absent) driven by
// playwright-core, which brings no browser of its own. Each launch gets a fresh profile directory.
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { chromium, type BrowserContext, type Page } from 'playwright-core';

export const CHROMIUM = '/usr/bin/chromium';
/** Screenshots of each page a test visits (gitignored): look at them after a change to the console. */
export const SCREENSHOTS = path.resolve(import.meta.dirname, '../screenshots');

export interface Browser {
  context: BrowserContext;
  page: Page;
  /** Saves a full-page screenshot as test/screenshots/<name>.png. */
  shot(name: string, page?: Page): Promise<string>;
  close(): Promise<void>;
}

export async function launchBrowser(viewport = { width: 1400, height: 900 }): Promise<Browser> {
  if (!existsSync(CHROMIUM)) throw new Error(`${CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium), as npm test does`);
  const profile = await mkdtemp(path.join(tmpdir(), 'outboxd-chromium-'));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    viewport,
    args: [
      '--headless',
      '--no-sandbox',
      '--disable-gpu',
      '--disable-quic',
      '--no-first-run',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
    ],
  });
  context.setDefaultTimeout(15_000);
  const page = context.pages()[0] ?? (await context.newPage());
  await mkdir(SCREENSHOTS, { recursive: true });
  return {
    context,
    page,
    async shot(name, p = page) {
      const file = path.join(SCREENSHOTS, `${name}.png`);
      await p.screenshot({ path: file, fullPage: true });
      return file;
    },
    async close() {
      await context.close();
      await rm(profile, { recursive: true, force: true });
    },
  };
}
